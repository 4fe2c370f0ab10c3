"""Parallel sampling: n samples and best_of fork from one computed prompt and share its blocks."""

from __future__ import annotations

from engine import LLMEngine, RequestOutput, SamplingParams


def run_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return finished


def test_n_samples_forked_from_one_prompt_equal_separately_seeded_requests(tiny_dummy_model):
    """Sharing the prompt's blocks (and copying the partial one on first write) changes nothing:
    sample i of a seeded n-sample request equals a lone request seeded seed + i."""
    def engine() -> LLMEngine:
        return LLMEngine(str(tiny_dummy_model), dtype="float32", device="cpu", load_format="dummy",
                         block_size=4, num_kv_blocks=128)

    prompt = list(range(3, 14))  # 11 tokens: the third block is shared half-full
    shared = engine()
    shared.add_request("n", prompt, SamplingParams(n=4, seed=5, temperature=1.0, max_tokens=12, ignore_eos=True))
    outputs = run_to_completion(shared)
    alone = engine()
    for i in range(4):
        alone.add_request(str(i), prompt, SamplingParams(seed=5 + i, temperature=1.0, max_tokens=12, ignore_eos=True))
    singles = run_to_completion(alone)
    assert [c.token_ids for c in outputs["n"].outputs] == [singles[str(i)].outputs[0].token_ids for i in range(4)]
    assert len({tuple(c.token_ids) for c in outputs["n"].outputs}) > 1  # the samples did diverge
    assert shared.counters.prompt_tokens_computed == len(prompt)  # the prompt ran once
    shared.block_manager.check_invariants()


def test_best_of_returns_the_n_most_likely_samples(tiny_dummy_model):
    engine = LLMEngine(str(tiny_dummy_model), dtype="float32", device="cpu", load_format="dummy")
    params = SamplingParams(n=2, best_of=5, seed=1, temperature=1.0, max_tokens=8, ignore_eos=True)
    engine.add_request("b", [5, 6, 7], params)
    everything = LLMEngine(str(tiny_dummy_model), dtype="float32", device="cpu", load_format="dummy")
    everything.add_request("all", [5, 6, 7], SamplingParams(n=5, seed=1, temperature=1.0, max_tokens=8, ignore_eos=True))
    best = run_to_completion(engine)["b"].outputs
    candidates = sorted(run_to_completion(everything)["all"].outputs, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in best] == [c.token_ids for c in candidates[:2]]
    assert [c.index for c in best] == [0, 1]
