"""The supervisor of `conveyor up`, on real child processes: a child that dies is restarted after its backoff and
counted; one that keeps dying is given up on, which stops the stack."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conveyor.local_stack import ManagedProcess
from conveyor.supervisor import Backoff, Child, ChildKeepsFailing, Supervisor

FAST = Backoff(base_delay_s=0.05, max_delay_s=0.2, failure_window_s=60.0, max_failures=3)


class SleepingChild:
    """A real process that sleeps until killed; `exit_at_once` makes every start die immediately."""

    def __init__(self, log_path: Path, exit_at_once: bool = False) -> None:
        self.log_path = log_path
        self.code = "raise SystemExit(3)" if exit_at_once else "import time; time.sleep(60)"
        self.starts = 0
        self.process = self._start()

    def _start(self) -> ManagedProcess:
        self.starts += 1
        return ManagedProcess("sleeper", [sys.executable, "-c", self.code], {}, self.log_path)

    def child(self) -> Child:
        def restart() -> None:
            self.process.stop()
            self.process = self._start()

        return Child("sleeper", lambda: self.process.process.poll() is None, restart, self.log_path)


def supervise_until(supervisor: Supervisor, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the supervisor did not get there in time"
        supervisor.check()
        time.sleep(0.02)


def test_a_killed_child_is_restarted_and_counted(tmp_path: Path) -> None:
    sleeper = SleepingChild(tmp_path / "sleeper.log")
    child = sleeper.child()
    announced: list[str] = []
    restarted: list[int] = []
    supervisor = Supervisor([child], FAST, announced.append, lambda c: restarted.append(c.restarts))
    try:
        for kill in range(1, 3):
            sleeper.process.kill()
            supervise_until(supervisor, lambda: child.restarts == kill and child.running())
        assert sleeper.starts == 3 and restarted == [1, 2]
        assert any("stopped unexpectedly; restarting it in" in line for line in announced), announced
    finally:
        sleeper.process.stop()


def test_a_child_that_keeps_dying_is_given_up_on(tmp_path: Path) -> None:
    sleeper = SleepingChild(tmp_path / "sleeper.log", exit_at_once=True)
    supervisor = Supervisor([sleeper.child()], FAST, lambda _: None, lambda _: None)
    with pytest.raises(ChildKeepsFailing, match="3 times within 60 s"):
        supervise_until(supervisor, lambda: False)
    assert sleeper.starts == FAST.max_failures


def test_backoff_doubles_up_to_its_cap(tmp_path: Path) -> None:
    now = [0.0]
    sleeper = SleepingChild(tmp_path / "sleeper.log", exit_at_once=True)
    announced: list[str] = []
    backoff = Backoff(base_delay_s=1.0, max_delay_s=3.0, failure_window_s=1000.0, max_failures=10)
    supervisor = Supervisor([sleeper.child()], backoff, announced.append, lambda _: None, clock=lambda: now[0])
    delays = []
    for _ in range(4):
        sleeper.process.process.wait()
        supervisor.check()  # sees the death, schedules the restart
        delays.append(announced[-1].split("restarting it in ")[1].split(" s")[0])
        now[0] += 10.0
        supervisor.check()  # restarts it
    assert delays == ["1", "2", "3", "3"]
