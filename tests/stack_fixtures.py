"""Fixtures for the real service: a scratch PostgreSQL database, a private Redis key prefix, API and worker processes.

Every test run gets its own database and Redis prefix (and, from `service_fixtures`, its own bucket), so runs
that share this machine's servers, CI's included, never see each other's data or queues.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis import Redis

from conveyor.local_stack import (
    ManagedProcess,
    free_port,
    scratch_database,
    scratch_redis_prefix,
    start_api,
    start_beat,
    start_worker,
)
from jobs import db
from jobs.keys import create_key_in_database
from jobs.settings import S3Settings, Settings, replace

POSTGRES_ADMIN_URL = os.environ.get(
    "CONVEYOR_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("CONVEYOR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
# The test stack's engine dtype. `auto` runs bfloat16 on a CPU with AVX-512 BF16 and float32 on an AVX2-only one:
# float32 here approximates the slower host's workers (README, "Tests").
STACK_DTYPE = os.environ.get("CONVEYOR_TEST_DTYPE", "auto")


@pytest.fixture
def empty_database_url() -> Iterator[str]:
    with scratch_database(POSTGRES_ADMIN_URL) as url:
        yield url


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    with scratch_database(POSTGRES_ADMIN_URL) as url:
        db.upgrade(url)
        yield url


@pytest.fixture(scope="session")
def service_settings(database_url: str, s3_settings: S3Settings) -> Iterator[Settings]:
    with scratch_redis_prefix(REDIS_URL) as prefix:
        yield Settings(
            database_url=database_url,
            redis_url=REDIS_URL,
            redis_prefix=prefix,
            s3=s3_settings,
            dtype=STACK_DTYPE,
            chunk_size=16,
            rag_documents_per_chunk=2,  # RAG jobs of a few documents still run several chunks and merge their parts
            worker_concurrency=4,
            task_visibility_timeout=15,  # a killed worker's tasks come back within ~20 s
            # Renewed every third of it: a renewal thread starved for 20 s is past what a machine at load 8 does.
            chunk_lease_seconds=20,
            engine_options={"max_num_seqs": 64},
            api_port=free_port(),
            worker_metrics_port=0,  # not the fixed default: test runs share this machine; tests that scrape pick a free one
        )


@dataclass
class Stack:
    """One API process and one worker process sharing a configuration."""

    settings: Settings
    folder: Path
    api: ManagedProcess | None = None
    worker: ManagedProcess | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.api_host}:{self.settings.api_port}/v1"

    def start_api(self) -> None:
        self.api = start_api(self.settings, self.folder / "api.log")

    def start_worker(self) -> ManagedProcess:
        self.worker = start_worker(self.settings, self.folder / "worker.log")
        return self.worker

    def new_key(self, project: str) -> str:
        return create_key_in_database(self.settings.database_url, project).secret

    def stop(self) -> None:
        for process in (self.worker, self.api):
            if process is not None:
                process.stop()


@contextmanager
def running_stack(settings: Settings, folder: Path, with_worker: bool = True) -> Iterator[Stack]:
    folder.mkdir(parents=True, exist_ok=True)
    stack = Stack(settings, folder)
    try:
        stack.start_api()
        if with_worker:
            stack.start_worker()
        yield stack
    finally:
        stack.stop()


@contextmanager
def running_stack_with_beat(settings: Settings, folder: Path) -> Iterator[Stack]:
    """A stack and its own beat, for tests of what the periodic sweeps do."""
    with running_stack(settings, folder) as stack:
        beat = start_beat(settings, folder / "beat.log")
        try:
            yield stack
        finally:
            beat.stop()


@pytest.fixture(scope="session")
def stack(service_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The shared stack: API + one worker on SmolLM2, for tests that leave it running. A test that starts work on
    it waits for that work or cancels it: `shared_worker_left_idle` checks after every module."""
    with running_stack(service_settings, tmp_path_factory.mktemp("stack")) as shared:
        SHARED_STACKS.append(shared)
        try:
            yield shared
        finally:
            SHARED_STACKS.remove(shared)


SHARED_STACKS: list[Stack] = []  # the session's shared stack, while it runs
# How long a module's trailing work (a finalize, a webhook attempt) may take to drain, on a machine at load 8.
IDLE_GRACE_SECONDS = 60.0


def unfinished_work(settings: Settings) -> list[str]:
    """What the workers of these settings' Redis prefix still have to do: chunks holding their lease, tasks queued
    or delivered and not yet acknowledged."""
    redis = Redis.from_url(settings.redis_url)
    prefix = settings.redis_prefix
    try:
        work = [key.decode().removeprefix(prefix) for key in redis.scan_iter(f"{prefix}chunk-lease:*")]
        for pattern in ("control*", "gpu*"):  # every queue, at every message priority
            work += [
                f"{length} queued in {key.decode().removeprefix(prefix)!r}"
                for key in redis.scan_iter(f"{prefix}{pattern}")
                if redis.type(key) == b"list" and (length := redis.llen(key))
            ]
        if unacked := redis.hlen(f"{prefix}unacked"):
            work.append(f"{unacked} delivered and not acknowledged")
        return work
    finally:
        redis.close()


@pytest.fixture(scope="module", autouse=True)
def shared_worker_left_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the module that leaves work running on the shared worker: it would take the worker (and a core) from
    every test after it."""
    yield
    for shared in SHARED_STACKS:
        deadline = time.monotonic() + IDLE_GRACE_SECONDS
        while work := unfinished_work(shared.settings):
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{request.module.__name__} left work on the shared worker after {IDLE_GRACE_SECONDS:g} s: "
                    f"{work}; a test that starts a batch there waits for it or cancels it",
                    pytrace=False,
                )
            time.sleep(0.5)


@pytest.fixture(scope="module")
def api_only_stack(service_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An API process of a module's own, without a worker: for tests of what the API itself answers."""
    settings = replace(service_settings, api_port=free_port())
    with running_stack(settings, tmp_path_factory.mktemp("api"), with_worker=False) as stack:
        yield stack


@pytest.fixture
def private_stack_settings(service_settings: Settings) -> Iterator[Settings]:
    """Settings for a stack of a test's own: same database and bucket, its own queues and port."""
    with scratch_redis_prefix(REDIS_URL) as prefix:
        yield replace(service_settings, redis_prefix=prefix, api_port=free_port())
