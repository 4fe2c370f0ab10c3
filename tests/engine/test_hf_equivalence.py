"""The engine's correctness oracle: greedy output equals Hugging Face transformers' `generate`,
token for token in float32, whatever batching, chunked prefill or preemption happened."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import save_random_hf_model

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Give me a short recipe for pancakes, with quantities for four people and the steps in order.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Summarise the plot of Romeo and Juliet in one paragraph, mentioning the families and the ending.",
    "Name a mammal that can fly.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What does a compiler do? Answer briefly.",
    "Describe the water cycle, covering evaporation, condensation, precipitation and collection.",
    "Hi!",
    "What colour do you get when you mix blue and yellow?",
]
MAX_TOKENS = 20


def hf_greedy(model, prompts: list[list[int]], max_tokens: int, eos: int | None) -> list[list[int]]:
    """One prompt at a time: no padding, so HF's numbers are its cleanest."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
            )
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def smollm2_case(smollm2_folder):
    import transformers

    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(smollm2_folder)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    expected = hf_greedy(hf, prompts, MAX_TOKENS, tokenizer.eos_token_id)
    return str(smollm2_folder), prompts, expected


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def random_case(request, tmp_path_factory):
    import transformers

    folder = save_random_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(16)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = hf_greedy(hf, prompts, MAX_TOKENS, eos=None)
    return str(folder), prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
ENGINE_SETUPS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    # 24 blocks of 4 tokens cannot hold 16 sequences at once: forces recompute preemption
    "preemption": {"block_size": 4, "num_kv_blocks": 40, "max_num_batched_tokens": 64},
    # the pure torch path (no C++ CPU kernels), chunked so that cached prefixes are read back
    "torch_only": {"cpu_kernels": False, "max_num_batched_tokens": 16},
}


def run_engine(folder: str, prompts, setup: str, ignore_eos: bool):
    llm = LLM(model=folder, dtype="float32", device="cpu", **ENGINE_SETUPS[setup])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def test_smollm2_single_prompt_matches_hf(smollm2_case):
    folder, prompts, expected = smollm2_case
    _, got = run_engine(folder, prompts[:1], "default", ignore_eos=False)
    assert got == expected[:1]


def check_against_hf(case, setup: str, ignore_eos: bool) -> None:
    folder, prompts, expected = case
    llm, got = run_engine(folder, prompts, setup, ignore_eos=ignore_eos)
    assert got == expected
    if setup == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_smollm2_batch_matches_hf(smollm2_case, setup):
    check_against_hf(smollm2_case, setup, ignore_eos=False)


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_random_models_match_hf(random_case, setup):
    check_against_hf(random_case, setup, ignore_eos=True)
