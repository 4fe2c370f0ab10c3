"""Redis and PostgreSQL restarting mid-batch: the batch still completes, every custom_id exactly once.

The machine's own servers are shared, so these tests start private ones (redis-server and PostgreSQL 15's
initdb/pg_ctl, on free ports and temporary directories) and restart those, the same data directory on the same
port, while an API and a worker are running a batch against them."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai.types import Batch

from conveyor.local_stack import free_port
from jobs import db
from jobs.settings import Settings, replace
from tests.api.test_batch_service import COMPLETIONS, client_for, completion_file, read_jsonl
from tests.stack_fixtures import Stack, running_stack_with_beat

pytestmark = pytest.mark.slow

POSTGRES_BIN = Path("/usr/lib/postgresql/15/bin")
FINISHED = ("completed", "failed", "cancelled", "expired")
CHUNK_SIZE = 4
LINES = 24  # six chunks: when the first has completed, three run and one waits in the queue


@dataclass
class PrivateRedis:
    """redis-server with an append-only file, so a restart keeps the queues, as a production Redis would."""

    folder: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        argv += ["--appendonly", "yes", "--save", ""]
        log = (self.folder / "redis.log").open("ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        _wait_for_port(self.port)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # SIGTERM: Redis flushes its append-only file and exits
            self.process.wait(30)


@dataclass
class PrivatePostgres:
    """A PostgreSQL 15 cluster of its own; run as the `postgres` user when these tests run as root (initdb refuses root)."""

    folder: Path
    port: int

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def init(self) -> None:
        self._run("initdb", "-D", str(self.folder / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1"
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-l", str(self.folder / "postgres.log"), "-o", options, "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "fast", "-w", "stop")

    def _run(self, program: str, *args: str) -> None:
        argv = [str(POSTGRES_BIN / program), *args]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        subprocess.run(argv, check=True, capture_output=True)


def _wait_for_port(port: int, timeout_s: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s} s")


@pytest.fixture(scope="module")
def private_servers() -> Iterator[tuple[PrivateRedis, PrivatePostgres]]:
    if not (POSTGRES_BIN / "pg_ctl").exists() or shutil.which("redis-server") is None:
        pytest.skip("needs redis-server and PostgreSQL 15's pg_ctl")
    folder = Path(tempfile.mkdtemp(prefix="conveyor-resilience-"))
    if os.geteuid() == 0:  # the postgres user must own its cluster's directory
        os.chown(folder, pwd.getpwnam("postgres").pw_uid, -1)
    redis_folder = folder / "redis"
    redis_folder.mkdir()
    redis = PrivateRedis(redis_folder, free_port())
    postgres = PrivatePostgres(folder, free_port())
    redis.start()
    try:
        postgres.init()
        postgres.start()
        try:
            yield redis, postgres
        finally:
            postgres.stop()
    finally:
        redis.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def fragile_stack(
    private_servers: tuple[PrivateRedis, PrivatePostgres],
    service_settings: Settings,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    redis, postgres = private_servers
    database_url = postgres.admin_url  # the cluster is this module's alone: its default database will do
    db.upgrade(database_url)
    settings = replace(
        service_settings,
        database_url=database_url,
        redis_url=redis.url,
        redis_prefix="conveyor:",
        api_port=free_port(),
        # Small chunks, four at a time (two chunk slots and two control threads): a batch of 24 lines has chunks
        # running and queued across the outage, with a quarter of the generation work of six chunks of sixteen.
        chunk_size=CHUNK_SIZE,
        worker_concurrency=2,
        beat_interval_seconds=2.0,
    )
    # With beat, as production runs: a task lost in the outage (a chunk whose retry could not be sent, a finalize
    # enqueued while Redis was down) comes back through the recovery sweep, which is part of what is under test.
    with running_stack_with_beat(settings, tmp_path_factory.mktemp("resilience")) as stack:
        yield stack


def wait_through_outages(client: openai.OpenAI, batch_id: str, timeout_s: float = 300.0) -> Batch:
    """Poll until the batch finishes, taking the API's errors while a server is down as 'ask again'."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            batch = client.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError):
            batch = None
        if batch is not None and batch.status in FINISHED:
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} did not finish within {timeout_s} s")


def run_batch_across(stack: Stack, name: str, restart: Callable[[float], None], outage_s: float = 3.0) -> None:
    client = client_for(stack, stack.new_key(name))
    # Six chunks, four run at once: the outage comes after the first and before the last (48 lines in three chunks
    # that all ran at once could finish together before it, as they once did in a full run).
    data, good_ids = completion_file(name, LINES)
    upload = client.files.create(file=(f"{name}.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=COMPLETIONS, completion_window="24h")
    deadline = time.monotonic() + 180
    while (current := client.batches.retrieve(batch.id)).request_counts is None or current.request_counts.completed < CHUNK_SIZE:
        assert current.status in ("validating", "in_progress") and time.monotonic() < deadline, current
        time.sleep(0.2)
    assert current.status == "in_progress"

    restart(outage_s)

    done = wait_through_outages(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (len(good_ids), 1)
    outputs = read_jsonl(client, done.output_file_id)
    assert Counter(line["custom_id"] for line in outputs) == Counter(good_ids)
    assert len(read_jsonl(client, done.error_file_id)) == 1


def test_a_batch_survives_a_redis_restart(
    fragile_stack: Stack, private_servers: tuple[PrivateRedis, PrivatePostgres]
) -> None:
    redis, _ = private_servers

    def restart(outage_s: float) -> None:
        redis.stop()
        time.sleep(outage_s)
        redis.start()

    run_batch_across(fragile_stack, "redis-restart", restart)
    assert fragile_stack.worker is not None and fragile_stack.worker.process.poll() is None


def test_a_batch_survives_a_postgres_restart(
    fragile_stack: Stack, private_servers: tuple[PrivateRedis, PrivatePostgres]
) -> None:
    _, postgres = private_servers

    def restart(outage_s: float) -> None:
        postgres.stop()
        time.sleep(outage_s)
        postgres.start()

    run_batch_across(fragile_stack, "postgres-restart", restart)
    assert fragile_stack.worker is not None and fragile_stack.worker.process.poll() is None
