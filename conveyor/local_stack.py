"""Start the service's own processes (API, worker) on this machine, as tests, benchmarks and operators do,
and scratch databases and Redis prefixes for runs that must not see each other's data.

Each process gets the environment that reproduces a `Settings` (`Settings.to_env`), logs to a file, and is
started in its own session so that stopping it stops everything it spawned.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from redis import Redis
from sqlalchemy import create_engine, text

from jobs.settings import Settings


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )

    def wait_until(
        self, ready: Callable[[], bool], timeout_s: float, while_waiting: Callable[[], None] | None = None
    ) -> None:
        """Return once `ready()`, calling `while_waiting()` (if given) between looks. If the process exits, the time
        runs out or the wait is interrupted (Ctrl-C during a start), the process is stopped before the error
        propagates: the caller never got a handle to stop it."""
        deadline = time.monotonic() + timeout_s
        try:
            while not ready():
                if while_waiting is not None:
                    while_waiting()
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL to the whole process group: a crash, as far as the rest of the system can tell."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._log.close()

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def service_env(settings: Settings) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("CONVEYOR_") or key == "CONVEYOR_CACHE_DIR"
    }
    env.update(settings.to_env())
    return env


def start_api(
    settings: Settings,
    log_path: Path,
    timeout_s: float = 60.0,
    workers: int = 1,
    checkout: Path | None = None,
    while_waiting: Callable[[], None] | None = None,
) -> ManagedProcess:
    """`conveyor api` on settings.api_host:api_port with `workers` uvicorn processes; returns once it answers HTTP.
    `checkout`: run the code of another checkout of conveyor (run from its folder, whose packages `python -m` finds
    first), e.g. an earlier commit's to compare with; None: this process's."""
    argv = [sys.executable, "-m", "conveyor", "api", "--host", settings.api_host, "--port", str(settings.api_port)]
    argv += ["--workers", str(workers)]
    api = ManagedProcess("conveyor api", argv, service_env(settings), log_path, cwd=checkout)
    url = f"http://{settings.api_host}:{settings.api_port}/openapi.json"
    api.wait_until(lambda: _answers(url), timeout_s, while_waiting)
    return api


def start_worker(
    settings: Settings, log_path: Path, timeout_s: float = 180.0, while_waiting: Callable[[], None] | None = None
) -> ManagedProcess:
    """`conveyor worker`; returns once Celery reports it ready (the engine is loaded before that)."""
    return _start_logging_process("worker", settings, log_path, b" ready.", timeout_s, while_waiting)


def start_beat(
    settings: Settings, log_path: Path, timeout_s: float = 60.0, while_waiting: Callable[[], None] | None = None
) -> ManagedProcess:
    """`conveyor beat`; returns once it has started sending the periodic sweeps."""
    return _start_logging_process("beat", settings, log_path, b"beat: Starting", timeout_s, while_waiting)


def _start_logging_process(
    command: str,
    settings: Settings,
    log_path: Path,
    ready_line: bytes,
    timeout_s: float,
    while_waiting: Callable[[], None] | None,
) -> ManagedProcess:
    log_start = log_path.stat().st_size if log_path.exists() else 0
    process = ManagedProcess(f"conveyor {command}", [sys.executable, "-m", "conveyor", command], service_env(settings), log_path)

    def ready() -> bool:
        with log_path.open("rb") as log:
            log.seek(log_start)
            return ready_line in log.read()

    process.wait_until(ready, timeout_s, while_waiting)
    return process


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    """A new, empty database on the server `admin_url` points at; dropped afterwards, with whatever still holds it open."""
    name = f"conveyor_scratch_{secrets.token_hex(6)}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def scratch_redis_prefix(redis_url: str) -> Iterator[str]:
    """A fresh Redis key prefix; every key under it is deleted afterwards."""
    prefix = f"conveyor-scratch-{secrets.token_hex(6)}:"
    try:
        yield prefix
    finally:
        client = Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
        client.close()
