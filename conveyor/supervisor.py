"""Keeps `conveyor up`'s children running: one that dies is started again after a backoff, and one that keeps dying
stops the stack.

A death is logged, counted (the count is written to Redis so the API's `/metrics` exports it as
`conveyor_process_restarts_total`) and answered by a restart after `base_delay_s` doubled for every death within
the failure window, up to `max_delay_s`. A child that died `max_failures` times within `failure_window_s` (a start
that raises counts as a death) is considered broken: `ChildKeepsFailing` is raised and `up` stops everything, as
a crash loop that restarts forever would only hide the problem.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Backoff:
    base_delay_s: float = 1.0  # wait before the first restart; doubled for each further death in the window
    max_delay_s: float = 60.0  # longest wait before a restart
    failure_window_s: float = 600.0  # deaths older than this are forgotten
    max_failures: int = 5  # deaths within the window after which the child counts as broken


class ChildKeepsFailing(RuntimeError):
    pass


@dataclass
class Child:
    """Something `up` started and keeps running."""

    name: str
    running: Callable[[], bool]
    restart: Callable[[], None]  # stops what is left of it and starts it again; returns once it is ready
    log_path: Path
    restarts: int = 0
    _deaths: deque[float] = field(default_factory=deque)  # monotonic times, within the failure window
    _restart_at: float | None = None  # when a death has been seen: when to start it again


class Supervisor:
    def __init__(
        self,
        children: list[Child],
        backoff: Backoff,
        announce: Callable[[str], None],
        on_restart: Callable[[Child], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.children = children
        self.backoff = backoff
        self._announce = announce
        self._on_restart = on_restart
        self._clock = clock

    def check(self) -> None:
        """One pass: notice deaths, restart the children whose backoff has passed. Raises ChildKeepsFailing."""
        for child in self.children:
            now = self._clock()
            if child._restart_at is None:
                if child.running():
                    continue
                self._record_death(child, now, "stopped unexpectedly")
            if child._restart_at is not None and now >= child._restart_at:
                self._restart(child)

    def _record_death(self, child: Child, now: float, what: str) -> None:
        backoff = self.backoff
        child._deaths.append(now)
        while child._deaths and child._deaths[0] < now - backoff.failure_window_s:
            child._deaths.popleft()
        if len(child._deaths) >= backoff.max_failures:
            raise ChildKeepsFailing(
                f"{child.name} {what} {len(child._deaths)} times within {backoff.failure_window_s:.0f} s; "
                f"see {child.log_path}"
            )
        delay = min(backoff.base_delay_s * 2 ** (len(child._deaths) - 1), backoff.max_delay_s)
        child._restart_at = now + delay
        self._announce(f"{child.name} {what}; restarting it in {delay:.0f} s (see {child.log_path})")

    def _restart(self, child: Child) -> None:
        child._restart_at = None
        try:
            child.restart()
        except Exception as failure:
            self._record_death(child, self._clock(), f"failed to start ({failure})")
            return
        child.restarts += 1
        self._announce(f"{child.name} restarted ({child.restarts} restart(s) so far)")
        self._on_restart(child)
