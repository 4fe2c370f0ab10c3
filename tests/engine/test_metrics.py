"""Engine telemetry: the KV pool snapshot and the step counters agree with what ran."""

from __future__ import annotations

from engine import LLMEngine, SamplingParams


def test_stats_follow_a_workload(tiny_dummy_model):
    engine = LLMEngine(str(tiny_dummy_model), dtype="float32", device="cpu", load_format="dummy",
                       block_size=4, num_kv_blocks=64, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[7] * 10, [9] * 21, [11] * 3]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)

    engine.step()  # 10 + 21 tokens fit the 32-token budget; the third prompt gets 1 of its 3
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (3, 0)
    assert stats.kv_blocks_used == 3 + 6 + 1  # blocks of 4 for 10, 21 and 1 computed tokens
    assert stats.kv_slots_unused == (12 - 10) + (24 - 21) + (4 - 1)
    assert stats.kv_fragmentation == stats.kv_slots_unused / (stats.kv_blocks_used * 4)
    assert stats.counters.last_step_tokens == 32 and stats.counters.last_step_sequences == 3

    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_utilization == 0.0
    assert stats.counters.prompt_tokens_computed == sum(len(p) for p in prompts)
    assert stats.counters.generation_tokens == 6 * len(prompts)
    assert stats.counters.requests_finished == len(prompts)
    assert stats.counters.step_seconds >= stats.counters.last_step_seconds > 0
