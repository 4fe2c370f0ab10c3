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


def test_stats_count_swaps_preemptions_and_prefix_cache_hits(tiny_dummy_model):
    engine = LLMEngine(str(tiny_dummy_model), dtype="float32", device="cpu", load_format="dummy",
                       block_size=4, num_kv_blocks=12, preemption_mode="swap")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    shared = list(range(3, 11))  # two full blocks every request starts with
    engine.add_request("first", shared + [20], params)
    engine.step()  # computed and cached before the others arrive
    for i in range(3):
        engine.add_request(str(i), shared + [30 + i], params)
    max_swapped = 0
    while engine.has_unfinished_requests():
        engine.step()
        max_swapped = max(max_swapped, engine.stats().num_swapped)
    stats = engine.stats()
    assert stats.preemptions["swap"] > 0 and max_swapped > 0
    assert stats.blocks_swapped_out == stats.blocks_swapped_in > 0
    model = engine.model_config
    # K and V, per layer, 4 slots of kv_heads x head_dim float32 values
    bytes_per_block = 2 * model.num_hidden_layers * 4 * model.num_key_value_heads * model.head_dim * 4
    assert stats.swap_bytes == (stats.blocks_swapped_out + stats.blocks_swapped_in) * bytes_per_block
    assert stats.swap_bytes_per_second > 0
    assert stats.prefix_cache_queried_tokens == 4 * 9
    assert stats.prefix_cache_hit_tokens == 3 * 8  # the three later requests found both shared blocks
    assert stats.prefix_cache_hit_rate == stats.prefix_cache_hit_tokens / stats.prefix_cache_queried_tokens
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == 12 and stats.num_swapped == 0
    assert stats.mean_tokens_per_step == stats.counters.batched_tokens / stats.counters.steps
