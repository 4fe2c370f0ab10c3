"""Stopping and ordering batches, end to end: a cancel aborts requests already in the engine, an expired batch keeps
what finished and reports the rest as `batch_expired`, and a high-priority batch overtakes queued bulk work.

One API, one worker and beat (sweeping every second) on queues of this module's own."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from redis import Redis
from sqlalchemy import create_engine, text

from conveyor.local_stack import ManagedProcess, free_port, scratch_redis_prefix, start_api
from jobs.settings import Settings, replace
from tests.api.test_batch_service import COMPLETIONS, client_for, completion_line, jsonl, read_jsonl, wait_for
from tests.stack_fixtures import REDIS_URL, Stack, running_stack_with_beat

pytestmark = pytest.mark.slow

ABORT_BOUND_S = 5.0  # from the cancel's answer to the running chunks' aborts handed to the engine
COUNTING_PROMPT = "Count from 1 to 1000, separated by commas: 1, 2, 3,"


@pytest.fixture(scope="module")
def busy_stack(service_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("cancel-expiry-priority")
    with scratch_redis_prefix(REDIS_URL) as prefix:
        settings = replace(service_settings, redis_prefix=prefix, api_port=free_port(), beat_interval_seconds=1.0)
        with running_stack_with_beat(settings, folder) as stack:
            yield stack


def counting_requests(prefix: str, count: int, max_tokens: int, short_first: int = 0) -> tuple[bytes, set[str]]:
    """Requests that run to max_tokens; the first `short_first` (one chunk, say) stop after 4 tokens, so some
    results exist while the rest are still running."""
    lines = [
        completion_line(f"{prefix}-{i}", f"{COUNTING_PROMPT} (list {i})", max_tokens=4 if i < short_first else max_tokens)
        for i in range(count)
    ]
    return jsonl(lines), {line["custom_id"] for line in lines}


def start_batch(client: openai.OpenAI, name: str, data: bytes, **extra: Any) -> str:
    upload = client.files.create(file=(f"{name}.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint=COMPLETIONS, completion_window="24h", extra_body=extra or None
    )
    return batch.id


def wait_for_progress(client: openai.OpenAI, batch_id: str, completed: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (current := client.batches.retrieve(batch_id)).request_counts is None or (
        current.request_counts.completed < completed
    ):
        assert current.status in ("validating", "in_progress"), current
        assert time.monotonic() < deadline, current
        time.sleep(0.2)


def wait_for_running_chunks(stack: Stack, batch_id: str, indices: range, timeout_s: float = 120.0) -> None:
    """Until each chunk holds its Redis lease: then it is running (a cancel skips chunks without one)."""
    redis = Redis.from_url(stack.settings.redis_url)
    keys = [f"{stack.settings.redis_prefix}chunk-lease:{batch_id}:{index}" for index in indices]
    deadline = time.monotonic() + timeout_s
    while (running := redis.exists(*keys)) < len(keys):
        assert time.monotonic() < deadline, f"{running} of {len(keys)} chunks running"
        time.sleep(0.2)


def test_cancel_aborts_running_requests_and_keeps_finished_ones(busy_stack: Stack) -> None:
    client = client_for(busy_stack, busy_stack.new_key("cancel-project"))
    data, ids = counting_requests("cancel", 64, max_tokens=400, short_first=16)
    batch_id = start_batch(client, "cancel", data)
    wait_for_progress(client, batch_id, completed=1)
    # The three long chunks running (not merely queued), so there are requests in the engine to abort.
    wait_for_running_chunks(busy_stack, batch_id, range(1, 4))

    cancelling = client.batches.cancel(batch_id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    asked = time.monotonic()
    # The running chunks see the stop flag within their poll interval and hand their aborts to the engine loop
    # without waiting for the step in progress; the bound leaves room for a loaded 2-core machine.
    assert busy_stack.worker is not None
    aborted = f"batch {batch_id} cancelled: aborted"
    while aborted not in busy_stack.worker.log_path.read_text():
        assert time.monotonic() - asked < ABORT_BOUND_S, f"no abort within {ABORT_BOUND_S} s of the cancel"
        time.sleep(0.05)
    done = wait_for(client, batch_id, timeout_s=60)
    took = time.monotonic() - asked
    # Each running chunk still had hundreds of tokens to go; only aborting them in the engine ends this fast.
    assert done.status == "cancelled" and took < 30, (done, took)

    assert done.request_counts is not None
    assert done.request_counts.total == len(ids)
    assert 0 < done.request_counts.completed < len(ids) and done.request_counts.failed == 0
    outputs = read_jsonl(client, done.output_file_id)
    kept = Counter(line["custom_id"] for line in outputs)
    assert set(kept) <= ids and set(kept.values()) == {1} and len(outputs) == done.request_counts.completed
    assert all(line["response"]["body"]["choices"][0]["finish_reason"] != "abort" for line in outputs)
    assert done.error_file_id is None  # aborted requests leave no line, as in OpenAI's cancelled batches

    with pytest.raises(openai.ConflictError):  # a cancelled batch stays as it is
        client.batches.cancel(batch_id)


def test_expired_batch_keeps_finished_results_and_reports_the_rest(busy_stack: Stack) -> None:
    client = client_for(busy_stack, busy_stack.new_key("expiry-project"))
    data, ids = counting_requests("expire", 64, max_tokens=400, short_first=16)
    batch_id = start_batch(client, "expire", data)
    wait_for_progress(client, batch_id, completed=1)

    database = create_engine(busy_stack.settings.database_url)
    with database.begin() as connection:  # the 24 hours are up
        connection.execute(text("UPDATE batches SET expires_at = now() WHERE id = :id"), {"id": batch_id})
    database.dispose()

    done = wait_for(client, batch_id, timeout_s=60)
    assert done.status == "expired" and done.expired_at and done.completed_at is None, done
    assert done.request_counts is not None
    counts = done.request_counts
    assert counts.total == len(ids) and counts.completed + counts.failed == len(ids) and counts.completed > 0
    outputs = read_jsonl(client, done.output_file_id)
    errors = read_jsonl(client, done.error_file_id)
    assert len(outputs) == counts.completed and len(errors) == counts.failed
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}
    every_line = Counter(line["custom_id"] for line in outputs + errors)
    assert set(every_line) == ids and set(every_line.values()) == {1}


def test_a_short_completion_window_setting_expires_batches(busy_stack: Stack, tmp_path: Path) -> None:
    short = replace(busy_stack.settings, completion_window_seconds=2.0, api_port=free_port())
    api: ManagedProcess = start_api(short, tmp_path / "short-window-api.log")
    try:
        own = Stack(short, tmp_path)
        client = client_for(own, busy_stack.new_key("short-window-project"))
        data, ids = counting_requests("short", 64, max_tokens=400)
        batch_id = start_batch(client, "short", data)
        created = client.batches.retrieve(batch_id)
        assert created.expires_at == created.created_at + 2

        done = wait_for(client, batch_id, timeout_s=60)
        assert done.status == "expired", done
        assert done.request_counts is not None
        errors = read_jsonl(client, done.error_file_id)
        outputs = read_jsonl(client, done.output_file_id)
        every_line = Counter(line["custom_id"] for line in outputs + errors)
        assert set(every_line.values()) <= {1} and set(every_line) <= ids
        assert done.request_counts.completed + done.request_counts.failed == done.request_counts.total
    finally:
        api.stop()


def test_priority_is_validated_and_returned(busy_stack: Stack) -> None:
    client = client_for(busy_stack, busy_stack.new_key("priority-checks"))
    upload = client.files.create(file=("one.jsonl", jsonl([completion_line("one", "Hi")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as too_low:
        client.batches.create(
            input_file_id=upload.id, endpoint=COMPLETIONS, completion_window="24h", extra_body={"priority": -101}
        )
    assert too_low.value.body["param"] == "priority"  # type: ignore[index]
    urgent = client.batches.create(
        input_file_id=upload.id, endpoint=COMPLETIONS, completion_window="24h", extra_body={"priority": -7}
    )
    assert urgent.to_dict()["priority"] == -7
    assert client.batches.retrieve(urgent.id).to_dict()["priority"] == -7
    assert wait_for(client, urgent.id).status == "completed"


def test_a_high_priority_batch_overtakes_queued_bulk_work(busy_stack: Stack) -> None:
    client = client_for(busy_stack, busy_stack.new_key("priority-project"))
    bulk_data, _ = counting_requests("bulk", 960, max_tokens=16)
    bulk_id = start_batch(client, "bulk", bulk_data, priority=50)
    wait_for_progress(client, bulk_id, completed=1)

    urgent_data, urgent_ids = counting_requests("urgent", 16, max_tokens=16)
    urgent_id = start_batch(client, "urgent", urgent_data, priority=-50)
    urgent = wait_for(client, urgent_id, timeout_s=180)
    bulk = client.batches.retrieve(bulk_id)
    assert urgent.status == "completed" and len(read_jsonl(client, urgent.output_file_id)) == len(urgent_ids)
    # Behind ~60 queued bulk chunks in arrival order, the urgent chunk overtakes all but those the worker holds.
    assert bulk.status == "in_progress" and bulk.request_counts is not None, bulk
    assert bulk.request_counts.completed < 0.6 * bulk.request_counts.total, bulk.request_counts
    assert client.batches.cancel(bulk_id).status == "cancelling"
    assert wait_for(client, bulk_id, timeout_s=60).status == "cancelled"
