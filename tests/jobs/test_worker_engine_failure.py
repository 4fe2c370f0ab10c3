"""A worker whose engine fails (a tensor-parallel rank killed mid-chunk) gives the chunk's message back to its queue,
once, and exits with a non-zero status for its supervisor to restart it: the real Celery worker, Redis and a real
engine sharded over two CPU processes (tests/jobs/engine_failure_worker.py)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import Redis

from jobs.celery_app import TaskName, create_celery_app
from jobs.settings import Settings, replace
from jobs.worker import ENGINE_FAILED_EXIT_CODE
from tests.conftest import save_random_hf_model

pytestmark = pytest.mark.slow


def test_a_dead_rank_stops_the_worker_with_its_chunk_back_in_the_queue(tmp_path: Path) -> None:
    folder = save_random_hf_model("llama", tmp_path / "llama")
    prefix = f"test-engine-failure-{secrets.token_hex(4)}:"
    queue = "gpu.tiny-llama"
    app = create_celery_app(replace(Settings.from_env(), redis_prefix=prefix))
    app.send_task(TaskName.run_chunk, args=["batch_engine_failure", 0], queue=queue)
    redis = Redis.from_url(Settings.from_env().redis_url)
    try:
        started = time.monotonic()
        worker = subprocess.run(
            [sys.executable, "-m", "tests.jobs.engine_failure_worker", str(folder), queue],
            env={**os.environ, "CONVEYOR_REDIS_PREFIX": prefix, "OMP_NUM_THREADS": "1"},
            capture_output=True, text=True, timeout=180,
        )
        assert worker.returncode == ENGINE_FAILED_EXIT_CODE, worker.stderr[-4000:]
        assert re.search(r"reject requeue=True: .*tensor-parallel rank 1 \(pid \d+\) exited with code -9", worker.stderr)
        assert time.monotonic() - started < 120
        # The chunk's message is in its queue again, exactly once, and nothing is left unacknowledged to come back
        # later as a second copy.
        queued = [
            message for key in redis.scan_iter(f"{prefix}{queue}*") if redis.type(key) == b"list"
            for message in redis.lrange(key, 0, -1)
        ]
        assert len(queued) == 1 and b"batch_engine_failure" in queued[0]
        assert redis.hlen(f"{prefix}unacked") == 0
    finally:
        for key in redis.scan_iter(f"{prefix}*"):
            redis.delete(key)
        redis.close()
