"""Latency histograms (step time, time to first token, time per output token) and stats read through the engine loop
from another thread, as the worker's metrics endpoint reads them."""

from __future__ import annotations

from engine import LLMEngine, SamplingParams
from engine.engine_loop import EngineLoop
from engine.metrics import Histogram


def test_histogram_buckets_follow_prometheus_le_semantics():
    histogram = Histogram((0.1, 1.0))
    for observed in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(observed)
    assert histogram.counts == [2, 2, 1]  # <= 0.1, <= 1.0, above
    assert histogram.count == 5 and histogram.total == 0.05 + 0.1 + 0.5 + 1.0 + 7.0


def test_loop_stats_carry_latency_histograms_and_are_snapshots(tiny_dummy_model):
    engine = LLMEngine(str(tiny_dummy_model), dtype="float32", device="cpu", load_format="dummy",
                       block_size=4, num_kv_blocks=64)
    with EngineLoop(engine) as loop:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        handles = [loop.submit([7 + i] * (3 + i), params) for i in range(3)]
        handles.append(loop.submit([5, 6], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
        for handle in handles:
            handle.result(timeout=60)
        stats = loop.stats(timeout=10)

        counters = stats.counters
        assert counters.time_to_first_token.count == len(handles)
        assert counters.time_per_output_token.count == 3  # a one-token request has no time between tokens
        assert counters.step_time.count == counters.steps
        assert abs(counters.step_time.total - counters.step_seconds) < 1e-9

        loop.submit([9, 9, 9], params).result(timeout=60)
        assert counters.time_to_first_token.count == len(handles)  # taken before: later steps leave it alone
        assert loop.stats(timeout=10).counters.time_to_first_token.count == len(handles) + 1
