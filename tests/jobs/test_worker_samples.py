"""Workers' engine samples in a real Redis: recorded, read back as histories with rates, trimmed, and forgotten once
a worker stops sampling."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from redis import Redis

from conveyor.local_stack import scratch_redis_prefix
from engine.metrics import EngineStats, StepCounters
from jobs.telemetry import worker_samples
from jobs.telemetry.worker_samples import SAMPLES_KEPT, SampleRecorder, worker_histories
from tests.stack_fixtures import REDIS_URL


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    with scratch_redis_prefix(REDIS_URL) as prefix:
        yield prefix


def stats(generated: int, running: int, preempted: int = 0) -> EngineStats:
    return EngineStats(
        counters=StepCounters(generation_tokens=generated, prompt_tokens_computed=2 * generated),
        num_running=running, num_waiting=3, num_swapped=0, preemptions={"swap": preempted}, block_size=16,
        kv_blocks_total=100, kv_blocks_used=25, kv_blocks_cached=0, kv_slots_unused=0, host_blocks_total=0,
        host_blocks_used=0, blocks_swapped_out=0, blocks_swapped_in=0, swap_bytes=0, swap_seconds=0.0,
        prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0,
    )


def test_samples_become_histories_with_rates(redis_prefix: str) -> None:
    redis = Redis.from_url(REDIS_URL)
    readings = iter([stats(0, 1), stats(50, 4, preempted=1), stats(80, 2, preempted=1)])
    recorder = SampleRecorder(redis, redis_prefix, "gpu-0", ["smollm2"], lambda: next(readings))
    for _ in range(3):
        recorder.record()
        time.sleep(0.05)
    SampleRecorder(redis, redis_prefix, "gpu-1", ["other"], lambda: stats(0, 0)).record()

    histories = worker_histories(redis, redis_prefix)
    assert [history.name for history in histories] == ["gpu-0", "gpu-1"]
    first = histories[0]
    assert first.models == ["smollm2"] and [sample.running for sample in first.samples] == [1, 4, 2]
    assert first.samples[0].kv_utilization == 0.25 and first.samples[0].waiting == 3
    rates = first.rates("generation_tokens")
    assert len(rates) == 2 and all(rate > 0 for rate in rates)
    assert rates[0] == pytest.approx(50 / (first.samples[1].at - first.samples[0].at))
    assert first.rates("preemptions")[1] == 0.0


def test_only_the_last_samples_are_kept_and_silent_workers_leave(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis = Redis.from_url(REDIS_URL)
    recorder = SampleRecorder(redis, redis_prefix, "busy", ["m"], lambda: stats(0, 1))
    for _ in range(SAMPLES_KEPT + 5):
        recorder.record()
    assert len(worker_histories(redis, redis_prefix)[0].samples) == SAMPLES_KEPT
    later = time.time() + worker_samples.HISTORY_SECONDS + 1
    monkeypatch.setattr(worker_samples.time, "time", lambda: later)
    assert worker_histories(redis, redis_prefix) == []
