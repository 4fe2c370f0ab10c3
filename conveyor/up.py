"""`conveyor up`: the whole service on one machine, in the foreground, from one command.

Any backing service whose variable is not set (CONVEYOR_DATABASE_URL, CONVEYOR_REDIS_URL, CONVEYOR_S3_ENDPOINT_URL)
runs embedded (`conveyor.embedded`, `conveyor.seaweedfs`) with its data under one data directory; then the
migrations run, and the API, one worker and beat start with the settings that point at all of them. A child that
dies is restarted with a backoff (`conveyor.supervisor`); one that keeps dying stops the stack. SIGINT (Ctrl-C) or
SIGTERM stops everything in reverse order: beat, worker, API, then the servers. The processes all run in sessions of
their own, so a Ctrl-C in the terminal reaches only this process, which then stops them in order.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import select

from conveyor.child_logs import ChildLog
from conveyor.embedded import S3_CREDENTIALS_FILE, EmbeddedPostgres, EmbeddedRedis, s3_credentials, stable_port
from conveyor.local_stack import ManagedProcess, start_api, start_beat, start_worker
from conveyor.seaweedfs import SeaweedFS
from conveyor.supervisor import Backoff, Child, Supervisor
from conveyor.worker_groups import device_groups
from jobs import db
from jobs.keys import CreatedKey, create_key
from jobs.models import ApiKey
from jobs.schedules.definitions import inbox_uri
from jobs.settings import Settings, replace
from jobs.telemetry.service_metrics import process_restarts_key

DATABASE_NAME = "conveyor"
FIRST_PROJECT = "default"
WORKER_START_TIMEOUT_S = 900.0  # the first start on a machine converts the model and builds the CPU kernels
WAITING_REPORT_INTERVAL_S = 15.0  # while a start is awaited, how often `up` says it is still waiting
_SUPERVISE_INTERVAL_S = 1.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def default_data_dir() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "conveyor"


@dataclass(frozen=True)
class UpOptions:
    data_dir: Path
    api_host: str | None = None  # None: CONVEYOR_API_HOST
    api_port: int | None = None  # None: CONVEYOR_API_PORT


class StopRequested(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it."""


def run_up(options: UpOptions) -> int:
    environ = os.environ
    data_dir = options.data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = Settings.from_env(environ)
    settings = replace(
        settings, api_host=options.api_host or settings.api_host, api_port=options.api_port or settings.api_port
    )
    children: list[Child] = []
    logs: list[ChildLog] = []
    exit_code = 0
    with _signals_stop(), ExitStack() as started:
        try:
            settings = _start_backing_services(settings, data_dir, environ, started, children)
            _announce("running the database migrations")
            db.upgrade(settings.database_url)
            settings = _with_worker_metrics_ports(settings, data_dir, environ)
            _start_service_processes(settings, data_dir / "logs", started, children, logs)
            # Created once everything runs, so the banner that shows it is sure to be printed.
            first_key = _create_first_key(settings.database_url)
            _print_banner(settings, data_dir, environ, first_key)
            _supervise(Supervisor(children, Backoff(), _announce, _restart_counter(settings)), logs)
        except StopRequested:
            _announce("stopping beat, worker, API, then the embedded servers")
        except Exception as failure:
            _announce(f"{failure}\nconveyor up: stopping everything")
            exit_code = 1
        finally:
            _ignore_stop_signals()  # while the ExitStack stops what started (see _signals_stop)
    _announce("stopped")
    return exit_code


@contextmanager
def _signals_stop() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM raise StopRequested once; while the stack stops, further ones are ignored,
    so an impatient second Ctrl-C cannot interrupt a server's shutdown halfway."""

    def request_stop(signum: int, frame: FrameType | None) -> None:
        _ignore_stop_signals()
        raise StopRequested

    previous = {name: signal.signal(name, request_stop) for name in _STOP_SIGNALS}
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(name, handler)


def _ignore_stop_signals() -> None:
    for name in _STOP_SIGNALS:
        signal.signal(name, signal.SIG_IGN)


def _start_backing_services(
    settings: Settings, data_dir: Path, environ: Mapping[str, str], started: ExitStack, children: list[Child]
) -> Settings:
    if "CONVEYOR_DATABASE_URL" not in environ:
        postgres = EmbeddedPostgres(data_dir / "postgres", stable_port(data_dir, "postgres"))
        _announce(f"starting PostgreSQL on port {postgres.port}")
        started.callback(postgres.stop)
        postgres.start()
        postgres.create_database(DATABASE_NAME)
        children.append(Child("PostgreSQL", lambda: postgres.running, postgres.start, postgres.log_path))
        settings = replace(settings, database_url=postgres.database_url(DATABASE_NAME))
    if "CONVEYOR_REDIS_URL" not in environ:
        redis = EmbeddedRedis(data_dir / "redis", stable_port(data_dir, "redis"))
        _announce(f"starting Redis on port {redis.port}")
        redis.start()
        started.callback(redis.stop)
        children.append(Child("Redis", lambda: redis.running, _stop_then(redis.stop, redis.start), redis.data_dir / "redis.log"))
        settings = replace(settings, redis_url=redis.url)
    # Set but empty means AWS itself (Settings reads it as None): only an absent variable asks for the embedded one.
    if "CONVEYOR_S3_ENDPOINT_URL" not in environ:
        credentials = s3_credentials(data_dir)
        seaweedfs = SeaweedFS(data_dir / "s3", access_key=credentials.access_key, secret_key=credentials.secret_key)
        _announce("starting SeaweedFS (S3)")
        started.enter_context(seaweedfs)
        children.append(
            Child("SeaweedFS", lambda: seaweedfs.running, _stop_then(seaweedfs.stop, seaweedfs.start), seaweedfs.log_path)
        )
        # boto3 reads credentials from the environment; the API, worker and beat processes inherit it from here.
        os.environ["AWS_ACCESS_KEY_ID"] = credentials.access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = credentials.secret_key
        os.environ.pop("AWS_SESSION_TOKEN", None)
        settings = replace(settings, s3=replace(settings.s3, endpoint_url=seaweedfs.endpoint_url))
    return settings


def _with_worker_metrics_ports(settings: Settings, data_dir: Path, environ: Mapping[str, str]) -> Settings:
    """A free port (saved in the data directory, as the servers' are) for the worker's metrics, one per worker of
    a device group, unless CONVEYOR_WORKER_METRICS_PORT says which (0: none): the default port may be another
    program's, and a worker that cannot listen runs without metrics."""
    if "CONVEYOR_WORKER_METRICS_PORT" in environ:
        return settings
    return replace(settings, worker_metrics_port=stable_port(data_dir, "worker-metrics", _worker_count(settings)))


def _worker_count(settings: Settings) -> int:
    """The engine processes `conveyor worker` runs: one per device group, one when no devices are set."""
    if not settings.worker_devices:
        return 1
    return len(device_groups(settings.worker_devices, settings.engine_config.tensor_parallel_size))


def _start_service_processes(
    settings: Settings, logs: Path, started: ExitStack, children: list[Child], child_logs: list[ChildLog]
) -> None:
    logs.mkdir(exist_ok=True)
    api, worker, beat = logs / "api.log", logs / "worker.log", logs / "beat.log"
    # (the log's name on the console, what the start is called, what it waits for, the log, the start)
    starters: list[tuple[str, str, str, Path, Callable[[Callable[[], None]], ManagedProcess]]] = [
        (
            "API", f"the API on port {settings.api_port}", "it answers HTTP", api,
            lambda waiting: start_api(settings, api, while_waiting=waiting),
        ),
        (
            "worker", "the worker", "it has loaded the model (a first start on a machine also converts it and builds "
            "the CPU kernels: minutes) and reports ready", worker,
            lambda waiting: start_worker(settings, worker, WORKER_START_TIMEOUT_S, while_waiting=waiting),
        ),
        (
            "beat", "beat", "it sends its first sweeps", beat,
            lambda waiting: start_beat(settings, beat, while_waiting=waiting),
        ),
    ]
    for log_name, name, awaited, log_path, start in starters:
        _announce(f"starting {name}; waiting until {awaited} (log: {log_path})")
        child_log = ChildLog.from_now(log_name, log_path)
        child_logs.append(child_log)
        began = time.monotonic()
        start_reporting = _reporting_start(start, name, child_log)
        slot = _ProcessSlot(start_reporting())
        _announce(f"{name} is ready ({time.monotonic() - began:.0f} s)")
        started.callback(slot.stop)
        restart = _stop_then(slot.stop, slot.replace(start_reporting))
        children.append(Child(slot.current.name, slot.running, restart, slot.current.log_path))


def _reporting_start(
    start: Callable[[Callable[[], None]], ManagedProcess], name: str, child_log: ChildLog
) -> Callable[[], ManagedProcess]:
    """A start (the first, and each restart) that reports on the console while it waits."""
    return lambda: start(_waiting_reporter(name, child_log))


def _waiting_reporter(name: str, child_log: ChildLog) -> Callable[[], None]:
    """Called while a start is awaited: repeats the child's errors at once, and every WAITING_REPORT_INTERVAL_S says
    how long it has been waiting, with the log's latest line as a sign of what the child is doing."""
    began = last_report = time.monotonic()

    def report() -> None:
        nonlocal last_report
        for error in child_log.new_errors():
            _announce(error)
        now = time.monotonic()
        if now - last_report >= WAITING_REPORT_INTERVAL_S:
            last_report = now
            latest = f"; its log's latest line: {child_log.last_line}" if child_log.last_line else ""
            _announce(f"still waiting for {name} ({now - began:.0f} s){latest}")

    return report


@dataclass
class _ProcessSlot:
    """The running instance of one service process, replaced by each restart."""

    current: ManagedProcess

    def running(self) -> bool:
        return self.current.process.poll() is None

    def stop(self) -> None:
        self.current.stop()

    def replace(self, start: Callable[[], ManagedProcess]) -> Callable[[], None]:
        def start_again() -> None:
            self.current = start()

        return start_again


def _stop_then(stop: Callable[[], None], start: Callable[[], None]) -> Callable[[], None]:
    """A restart: whatever is left of the last run (a log handle, a process group) goes before the new start."""

    def restart() -> None:
        stop()
        start()

    return restart


def _restart_counter(settings: Settings) -> Callable[[Child], None]:
    """Publishes a child's restart count where the API's /metrics reads it (Redis); a Redis that is itself down or
    restarting misses this update, and gets the count with the next one."""

    def publish(child: Child) -> None:
        client = Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.hset(process_restarts_key(settings.redis_prefix), child.name, child.restarts)
        except RedisError as unreachable:
            _announce(f"could not record the restart of {child.name} in Redis: {unreachable}")
        finally:
            client.close()

    return publish


def _create_first_key(database_url: str) -> CreatedKey | None:
    """A key for the first project when the database has none yet (a first start); None otherwise.
    Only its hash is stored: the banner shows the secret once."""
    engine = db.make_engine(database_url, pool_size=1)
    try:
        with db.make_session_factory(engine).begin() as session:
            if session.scalar(select(ApiKey.id).limit(1)) is not None:
                return None
            return create_key(session, FIRST_PROJECT)
    finally:
        engine.dispose()


def _supervise(supervisor: Supervisor, child_logs: list[ChildLog]) -> None:
    """Return never: wait for a signal (StopRequested), restarting children that die and repeating the errors they
    log; raise ChildKeepsFailing when one keeps dying."""
    while True:
        supervisor.check()
        for child_log in child_logs:
            for error in child_log.new_errors():
                _announce(error)
        time.sleep(_SUPERVISE_INTERVAL_S)


def _announce(message: str) -> None:
    print(f"conveyor up: {message}", file=sys.stderr, flush=True)


def _print_banner(settings: Settings, data_dir: Path, environ: Mapping[str, str], first_key: CreatedKey | None) -> None:
    api = f"http://{settings.api_host}:{settings.api_port}"

    def origin(variable: str, embedded_note: str = "") -> str:
        return f"(from {variable})" if variable in environ else f"(embedded{embedded_note})"

    s3_note = f"; credentials in {data_dir / S3_CREDENTIALS_FILE}"
    worker_metrics = (
        ", ".join(
            f"http://{settings.worker_metrics_host}:{settings.worker_metrics_port + index}/metrics"
            for index in range(_worker_count(settings))
        )
        if settings.worker_metrics_port
        else "none (CONVEYOR_WORKER_METRICS_PORT=0)"
    )
    lines = [
        f"conveyor is up; data in {data_dir}",
        f"  API         {api}/v1   (OpenAPI docs: {api}/docs)",
        f"  Console     {api}/console",
        f"  Metrics     {api}/metrics (API), {worker_metrics} (worker)",
        f"  PostgreSQL  {settings.database_url}   {origin('CONVEYOR_DATABASE_URL')}",
        f"  Redis       {settings.redis_url}   {origin('CONVEYOR_REDIS_URL')}",
        f"  S3          {settings.s3.endpoint_url or 'AWS'}, bucket {settings.s3.bucket}   "
        f"{origin('CONVEYOR_S3_ENDPOINT_URL', s3_note)}",
        f"  logs        {data_dir / 'logs'}",
    ]
    if first_key is not None:
        inbox = inbox_uri(settings.s3, first_key.project_id, "")
        lines += [
            f'API key of project "{first_key.project_name}" (shown only now; only its hash is stored): {first_key.secret}',
            f"  project id {first_key.project_id}; its inbox (what an input_prefix reads): {inbox}",
        ]
    lines += [
        f"More keys:  CONVEYOR_DATABASE_URL='{settings.database_url}' conveyor keys create --project NAME",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)
