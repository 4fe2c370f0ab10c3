"""The engine's correctness oracle: greedy output equals Hugging Face transformers' `generate`,
token for token in float32, whatever batching, chunked prefill, preemption (swap or recompute),
prefix caching, parallel sampling or admission order (static batches, prefix-aware order, lookahead)
happened."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import hf_smollm2, save_random_hf_model
from tests.engine.hf_oracle import SMOLLM2_MAX_TOKENS as MAX_TOKENS, hf_greedy

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"])
def random_case(request, tmp_path_factory):
    import transformers

    folder = save_random_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(16)]
    shared_prefix = [rng.randrange(3, 512) for _ in range(37)]  # so the prefix cache has hits to serve
    prompts = [shared_prefix + p if i % 2 else p for i, p in enumerate(prompts)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = hf_greedy(hf, prompts, MAX_TOKENS, eos=None)
    return str(folder), prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
TINY_POOL = {"block_size": 4, "num_kv_blocks": 40, "max_num_batched_tokens": 64}
ENGINE_SETUPS = {
    "default": {},  # swap preemption and prefix caching on
    "chunked_prefill": {"max_num_batched_tokens": 16},
    # 40 blocks of 4 tokens cannot hold 16 sequences at once: forces preemption
    "preemption_recompute": {**TINY_POOL, "preemption_mode": "recompute"},
    "preemption_swap": {**TINY_POOL, "preemption_mode": "swap"},
    # few seats, so prompts are admitted over many steps and later ones find earlier ones' blocks
    "prefix_caching": {"max_num_seqs": 3, "enable_prefix_caching": True},
    "no_prefix_caching": {"max_num_seqs": 3, "enable_prefix_caching": False},
    # the pure torch path (no C++ CPU kernels), chunked so that cached prefixes are read back
    "torch_only": {"cpu_kernels": False, "max_num_batched_tokens": 16},
    # decode rows sharing cached blocks (a chat template's system prompt, a shared prefix, n samples)
    # read them once as a group, however few tokens that saves
    "shared_prefix_decode": {"shared_prefix_min_saved_tokens": 1},
    # a batch of 5 runs until its last member finishes before the next is admitted
    "static_batching": {"scheduling_policy": "static", "max_num_seqs": 5},
    # prompts started in blocks about to be released, least-work victims; prefix-aware order is the default
    "lookahead_least_work": {**TINY_POOL, "lookahead_admission_steps": 8, "preemption_victim": "least_work"},
    "arrival_order": {"max_num_seqs": 3, "prefix_aware_ordering": False},
}


def run_engine(folder: str, prompts, setup: str, ignore_eos: bool, n: int = 1, options: dict | None = None):
    """`options`: the engine options of `setup` (ENGINE_SETUPS') when None."""
    llm = LLM(model=folder, dtype="float32", device="cpu", **(ENGINE_SETUPS[setup] if options is None else options))
    params = SamplingParams(n=n, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [[sample.token_ids for sample in o.outputs] for o in outputs]


def test_smollm2_single_prompt_matches_hf(smollm2_case):
    folder, prompts, expected = smollm2_case
    _, got = run_engine(folder, prompts[:1], "default", ignore_eos=False)
    assert got == [expected[:1]]


def check_against_hf(case, setup: str, ignore_eos: bool, n: int = 1, options: dict | None = None) -> LLM:
    folder, prompts, expected = case
    llm, got = run_engine(folder, prompts, setup, ignore_eos=ignore_eos, n=n, options=options)
    assert got == [[tokens] * n for tokens in expected]
    check_setup_exercised(llm, setup)
    return llm


def check_setup_exercised(llm, setup: str) -> None:
    """The setup did what it is named for (preempted, hit the prefix cache), and every block came back."""
    stats = llm.engine.stats()
    if setup.startswith("preemption_"):
        assert stats.preemptions[setup.removeprefix("preemption_")] > 0
    if setup == "prefix_caching":
        assert stats.prefix_cache_hit_tokens > 0
    assert stats.kv_blocks_used == 0 and stats.host_blocks_used == 0
    llm.engine.block_manager.check_invariants()


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_smollm2_batch_matches_hf(smollm2_case, setup):
    check_against_hf(smollm2_case, setup, ignore_eos=False)


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_random_models_match_hf(random_case, setup):
    check_against_hf(random_case, setup, ignore_eos=True)


@pytest.mark.parametrize("setup", ["default", "preemption_swap", "shared_prefix_decode"])
def test_parallel_greedy_samples_match_hf(smollm2_case, setup):
    """n = 3 samples fork from one prompt and share its blocks; greedy, each equals HF's output."""
    check_against_hf(smollm2_case, setup, ignore_eos=False, n=3)


def hf_beam_search(model, prompt: list[int], length_penalty: float, n: int, eos: int) -> list[list[int]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=4, num_return_sequences=n,
            length_penalty=length_penalty, early_stopping=False, max_new_tokens=MAX_TOKENS,
            eos_token_id=eos, pad_token_id=eos,
        )
    return [row[len(prompt):].tolist() for row in generated]


BEAM_PROMPTS = 6
LENGTH_PENALTIES = (1.0, 0.5)


@pytest.fixture(scope="module")
def hf_beams(smollm2_folder, smollm2_case) -> dict[float, list[list[list[int]]]]:
    import transformers

    from engine.tokenizer import Tokenizer

    _, prompts, _ = smollm2_case
    eos = Tokenizer.from_folder(smollm2_folder).eos_token_id
    hf = hf_smollm2()
    return {
        penalty: [hf_beam_search(hf, prompt, penalty, n=2, eos=eos) for prompt in prompts[:BEAM_PROMPTS]]
        for penalty in LENGTH_PENALTIES
    }


@pytest.mark.parametrize("setup", ["default", "preemption_swap", "preemption_recompute"])
def test_beam_search_matches_hf(smollm2_case, hf_beams, setup):
    """Beams fork and drop by block-table edits (copy-on-write on shared partial blocks), whatever
    preemption does to them (the tiny pools cannot hold every beam at once, so parked beams are
    evicted to let a sibling finish its step); the result equals HF's num_beams=4 search."""
    folder, prompts, _ = smollm2_case
    llm = LLM(model=folder, dtype="float32", device="cpu", **ENGINE_SETUPS[setup])
    eos = llm.tokenizer.eos_token_id
    for length_penalty in LENGTH_PENALTIES:
        params = SamplingParams(
            n=2, use_beam_search=True, beam_width=4, temperature=0.0, max_tokens=MAX_TOKENS, length_penalty=length_penalty
        )
        outputs = llm.generate(prompts[:BEAM_PROMPTS], params, use_tqdm=False)
        for expected, output in zip(hf_beams[length_penalty], outputs):
            got = [sample.token_ids for sample in output.outputs]
            # HF pads the shorter of its returned beams with eos
            assert got == [row[: len(tokens)] for row, tokens in zip(expected, got)]
            assert all(row[len(tokens):] == [eos] * (len(row) - len(tokens)) for row, tokens in zip(expected, got))
    stats = llm.engine.stats()
    if setup.startswith("preemption_"):
        assert stats.preemptions[setup.removeprefix("preemption_")] > 0
    assert stats.kv_blocks_used == 0 and stats.host_blocks_used == 0
    llm.engine.block_manager.check_invariants()
