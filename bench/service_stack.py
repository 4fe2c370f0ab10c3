"""A whole local service stack for the service benchmarks, brought up and torn down as one context manager.

SeaweedFS in a temporary folder with random credentials, a scratch PostgreSQL database with the migrations
applied, a scratch Redis prefix, an API process and, optionally, a worker process: the same pieces the tests
use (`conveyor.local_stack`), so a benchmark run never sees another run's data, queues or bucket. Process logs
stay in the temporary folder while the stack runs (`ServiceStack.folder`); everything is removed afterwards.

The S3 credentials go into this process's environment for the duration (boto3 reads them from there, and the
API and worker processes inherit them), as does `OMP_NUM_THREADS` when `torch_threads` is given, which sets
the worker's torch thread count.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.local_stack import (
    ManagedProcess,
    free_port,
    scratch_database,
    scratch_redis_prefix,
    start_api,
    start_worker,
)
from conveyor.seaweedfs import SeaweedFS
from jobs import db
from jobs.keys import create_key_in_database
from jobs.settings import S3Settings, Settings

POSTGRES_ADMIN_URL = os.environ.get("CONVEYOR_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("CONVEYOR_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


@dataclass
class ServiceStack:
    settings: Settings
    folder: Path  # process logs: api.log, worker.log, seaweedfs/weed.log
    api_key: str  # a fresh key of the project "bench"
    api: ManagedProcess
    worker: ManagedProcess | None

    @property
    def base_url(self) -> str:
        """What `openai.OpenAI(base_url=...)` takes."""
        return f"http://{self.settings.api_host}:{self.settings.api_port}/v1"


@contextmanager
def service_stack(
    *,
    with_worker: bool,
    api_workers: int = 1,
    torch_threads: int | None = None,
    api_checkout: Path | None = None,
    **settings: Any,
) -> Iterator[ServiceStack]:
    """Bring up the stack; `settings` are `Settings` fields (chunk_size, engine_options, ...) over the defaults;
    `api_checkout`: the API runs that checkout's code (`start_api`)."""
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as tmp:
        folder = Path(tmp)
        s3 = SeaweedFS(folder / "seaweedfs", access_key=f"BENCH{secrets.token_hex(8).upper()}", secret_key=secrets.token_hex(20))
        threads = {} if torch_threads is None else {"OMP_NUM_THREADS": str(torch_threads)}
        with (
            _environment(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key, AWS_SESSION_TOKEN=None, **threads),
            s3,
            scratch_database(POSTGRES_ADMIN_URL) as database_url,
            scratch_redis_prefix(REDIS_URL) as redis_prefix,
        ):
            db.upgrade(database_url)
            stack_settings = Settings(
                database_url=database_url,
                redis_url=REDIS_URL,
                redis_prefix=redis_prefix,
                s3=S3Settings(endpoint_url=s3.endpoint_url, bucket=f"conveyor-bench-{secrets.token_hex(4)}"),
                api_port=free_port(),
                **settings,
            )
            api = start_api(stack_settings, folder / "api.log", workers=api_workers, checkout=api_checkout)
            worker: ManagedProcess | None = None
            try:
                if with_worker:
                    worker = start_worker(stack_settings, folder / "worker.log")
                yield ServiceStack(stack_settings, folder, create_key_in_database(database_url, "bench").secret, api, worker)
            finally:
                for process in (worker, api):
                    if process is not None:
                        process.stop()


@contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    """Set (or, for None, remove) environment variables, restoring the previous values afterwards."""
    saved: Mapping[str, str | None] = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _set(name, value)
        yield
    finally:
        for name, value in saved.items():
            _set(name, value)


def _set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
