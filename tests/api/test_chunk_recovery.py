"""Every batch ends, on the real stack (API, worker, beat; PostgreSQL, Redis, SeaweedFS): a vanished input fails its
chunks' requests at once, a lost chunk task is sent again by the recovery sweep, a killed worker's chunk runs again
within about a lease (not the 10-minute visibility timeout), and a worker stalled past its lease duplicates nothing.

The stack runs the production visibility timeout (600 s: what a lost chunk would wait without the sweep) and half the
production lease (30 s, renewed every 10 s: safe at load 8): every wait these tests make is a lease or two, so the
half lease halves the module's time, and a chunk back within about two leases of its worker's death is the same
claim at either size (1.5 leases plus a beat interval: under 50 s here, under two minutes at the default 60 s).
Its chunks hold four requests and a worker runs four at once (two chunk slots and the two control threads, which
take chunks when idle), so a batch of 24 lines has chunks queued while others run.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from redis import Redis
from sqlalchemy import select

from conveyor.local_stack import (
    ManagedProcess,
    free_port,
    scratch_database,
    scratch_redis_prefix,
    start_worker,
)
from jobs.enqueue import chunk_queue
from jobs.db import make_engine, make_session_factory, upgrade
from jobs.models import Batch
from jobs.object_keys import file_key
from jobs.settings import Settings, replace
from jobs.storage import ObjectStore
from tests.api.test_batch_service import COMPLETIONS, client_for, completion_line, jsonl, read_jsonl, wait_for
from tests.stack_fixtures import POSTGRES_ADMIN_URL, REDIS_URL, Stack, running_stack_with_beat

pytestmark = pytest.mark.slow

DEFAULT_LEASE_SECONDS = Settings.model_fields["chunk_lease_seconds"].default
LEASE_SECONDS = DEFAULT_LEASE_SECONDS // 2
VISIBILITY_TIMEOUT_SECONDS = Settings.model_fields["task_visibility_timeout"].default
LINES = 24  # six chunks of four: four running, two queued


@pytest.fixture(scope="module")
def recovery_stack(service_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("chunk-recovery")
    # A database of its own too: its beat's recovery sweep would otherwise send again other stacks' chunks, whose
    # queues it does not see.
    with scratch_redis_prefix(REDIS_URL) as prefix, scratch_database(POSTGRES_ADMIN_URL) as database_url:
        upgrade(database_url)
        settings = replace(
            service_settings,
            database_url=database_url,
            redis_prefix=prefix,
            api_port=free_port(),
            chunk_size=4,
            worker_concurrency=2,
            chunk_lease_seconds=LEASE_SECONDS,
            task_visibility_timeout=VISIBILITY_TIMEOUT_SECONDS,
            beat_interval_seconds=2.0,
        )
        with running_stack_with_beat(settings, folder) as stack:
            yield stack


def start_batch(stack: Stack, project: str, count: int, max_tokens: int) -> tuple[openai.OpenAI, str, str, set[str]]:
    """A batch of `count` completion requests; returns its client, batch id, input file id and custom ids."""
    client = client_for(stack, stack.new_key(project))
    lines = [completion_line(f"{project}-{i}", f"Once upon a time, in story {i},", max_tokens=max_tokens) for i in range(count)]
    upload = client.files.create(file=(f"{project}.jsonl", jsonl(list(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=COMPLETIONS, completion_window="24h")
    return client, batch.id, upload.id, {line["custom_id"] for line in lines}


def wait_for_a_running_chunk(stack: Stack, batch_id: str, timeout_s: float = 120.0) -> None:
    redis = Redis.from_url(stack.settings.redis_url)
    deadline = time.monotonic() + timeout_s
    while not list(redis.scan_iter(f"{stack.settings.redis_prefix}chunk-lease:{batch_id}:*")):
        assert time.monotonic() < deadline, f"no chunk of {batch_id} started within {timeout_s} s"
        time.sleep(0.2)
    redis.close()


def assert_each_request_once(client: openai.OpenAI, batch_id: str, custom_ids: set[str]) -> None:
    done = client.batches.retrieve(batch_id)
    answered = Counter(line["custom_id"] for line in read_jsonl(client, done.output_file_id))
    failed = Counter(line["custom_id"] for line in read_jsonl(client, done.error_file_id))
    assert answered + failed == Counter(custom_ids), (answered, failed)
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (sum(answered.values()), sum(failed.values()))


def test_a_running_batchs_input_cannot_be_deleted_and_a_vanished_one_fails_its_requests_at_once(
    recovery_stack: Stack, object_store: ObjectStore
) -> None:
    client, batch_id, file_id, custom_ids = start_batch(recovery_stack, "vanished-input", LINES, max_tokens=24)
    wait_for_a_running_chunk(recovery_stack, batch_id)

    with pytest.raises(openai.ConflictError) as refused:
        client.files.delete(file_id)
    assert refused.value.body["code"] == "file_in_use" and batch_id in refused.value.body["message"]  # type: ignore[index]
    # The bytes vanish anyway (an operator, a lifecycle rule): the chunks not yet run cannot read their lines.
    object_store.delete(file_key(project_of(recovery_stack, batch_id), file_id))
    started = time.monotonic()
    done = wait_for(client, batch_id, timeout_s=180)
    assert done.status == "completed", done
    assert time.monotonic() - started < 120  # not ~10 minutes of retries
    assert_each_request_once(client, batch_id, custom_ids)
    errors = read_jsonl(client, done.error_file_id)
    assert errors and all(line["error"]["code"] == "chunk_failed" and file_id in line["error"]["message"] for line in errors)

    assert client.files.delete(file_id).deleted  # the batch has ended: its input may go now


def project_of(stack: Stack, batch_id: str) -> str:
    engine = make_engine(stack.settings.database_url)
    with make_session_factory(engine)() as session:
        project = session.scalar(select(Batch.project_id).where(Batch.id == batch_id))
    engine.dispose()
    assert project is not None
    return project


def test_a_batch_whose_queued_chunk_tasks_were_lost_completes_through_the_recovery_sweep(recovery_stack: Stack) -> None:
    client, batch_id, _, custom_ids = start_batch(recovery_stack, "purged-queue", LINES, max_tokens=16)
    wait_for_a_running_chunk(recovery_stack, batch_id)
    redis = Redis.from_url(recovery_stack.settings.redis_url)
    queues = list(redis.scan_iter(f"{recovery_stack.settings.redis_prefix}{chunk_queue(None)}*"))  # every model's
    assert redis.delete(*queues) >= 1  # the chunks still queued are gone: only the sweep can send them again
    redis.close()
    done = wait_for(client, batch_id, timeout_s=180)
    assert done.status == "completed", done
    assert_each_request_once(client, batch_id, custom_ids)
    assert (done.request_counts.completed, done.request_counts.failed) == (len(custom_ids), 0)  # type: ignore[union-attr]


def test_a_killed_workers_chunk_runs_again_within_about_a_lease(recovery_stack: Stack) -> None:
    client, batch_id, _, custom_ids = start_batch(recovery_stack, "killed-worker", LINES, max_tokens=16)
    wait_for_a_running_chunk(recovery_stack, batch_id)
    assert recovery_stack.worker is not None
    recovery_stack.worker.kill()  # kill -9 mid-chunk: its messages stay unacknowledged for the visibility timeout
    killed = time.monotonic()
    recovery_stack.start_worker()  # as `conveyor up` restarts it
    done = wait_for(client, batch_id, timeout_s=180)
    took = time.monotonic() - killed
    assert done.status == "completed", done
    # The visibility timeout is 600 s: only the sweep brings the chunks back this soon (the bound: 3 minutes
    # with the default lease, twice this one).
    assert took <= 180 < VISIBILITY_TIMEOUT_SECONDS, took
    assert_each_request_once(client, batch_id, custom_ids)
    assert (done.request_counts.completed, done.request_counts.failed) == (len(custom_ids), 0)  # type: ignore[union-attr]


def chunk_leases(stack: Stack, batch_id: str) -> dict[bytes, bytes | None]:
    """The batch's chunk leases now: key -> holder token."""
    redis = Redis.from_url(stack.settings.redis_url)
    try:
        keys = list(redis.scan_iter(f"{stack.settings.redis_prefix}chunk-lease:{batch_id}:*"))
        return dict(zip(keys, redis.mget(keys))) if keys else {}
    finally:
        redis.close()


def taken_over(now: dict[bytes, bytes | None], held: dict[bytes, bytes | None]) -> set[bytes]:
    """The leases of `held` another holder has now (a lapsed lease nobody took is not taken over)."""
    return {key for key, token in held.items() if now.get(key) not in (None, token)}


def test_a_worker_stalled_past_its_lease_duplicates_nothing(recovery_stack: Stack, tmp_path: Path) -> None:
    stalled = recovery_stack.worker
    assert stalled is not None
    client, batch_id, _, custom_ids = start_batch(recovery_stack, "stalled-worker", LINES, max_tokens=16)
    wait_for_a_running_chunk(recovery_stack, batch_id)
    os.kill(stalled.process.pid, signal.SIGSTOP)  # its leases lapse; the other worker takes its chunks over
    held = chunk_leases(recovery_stack, batch_id)
    other: ManagedProcess | None = None
    try:
        try:
            # Started now, its start overlaps the stalled worker's leases lapsing: it takes the queued chunks, then
            # the stalled ones once the sweep sends them again.
            other = start_worker(recovery_stack.settings, tmp_path / "other-worker.log")
            # Resumed as soon as another worker has held each chunk it held (or the batch is done): both may then run
            # the same chunks at once, and the stalled one must find its leases lost.
            deadline = time.monotonic() + 180
            taken: set[bytes] = set()  # another holder was seen on each: the stalled one's lease is lost for good
            while (taken := taken | taken_over(chunk_leases(recovery_stack, batch_id), held)) != held.keys():
                if client.batches.retrieve(batch_id).status == "completed":
                    break
                assert time.monotonic() < deadline, "the stalled worker's chunks were never taken over"
                time.sleep(0.5)
        finally:
            os.kill(stalled.process.pid, signal.SIGCONT)
        done = wait_for(client, batch_id, timeout_s=180)
        assert done.status == "completed", done
        # Resumed, the stalled worker finishes its requests and finds its chunks another's: nothing is written twice.
        deadline = time.monotonic() + 120
        log = stalled.log_path.read_text()
        while "results dropped" not in log and "output already written" not in log:
            assert time.monotonic() < deadline, "the resumed worker never settled its stalled chunks"
            time.sleep(1)
            log = stalled.log_path.read_text()
        assert_each_request_once(client, batch_id, custom_ids)
        assert (done.request_counts.completed, done.request_counts.failed) == (len(custom_ids), 0)  # type: ignore[union-attr]
        assert client.batches.retrieve(batch_id).request_counts == done.request_counts
    finally:
        if other is not None:
            other.stop()
