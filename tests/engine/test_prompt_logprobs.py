"""Prompt log-probs (SamplingParams.prompt_logprobs) against the oracle: Hugging Face's log_softmax of the prompt's
logits in float32, on a tiny random Llama, through chunked prefill, a prefix cache holding the prompt, and
recompute preemption."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import save_random_hf_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_random_hf_model("llama", tmp_path_factory.mktemp("llama")))


def hf_prompt_logprobs(folder: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


def test_prompt_logprobs_equal_hf_log_softmax_through_chunks_cache_and_preemption(tiny_llama: str) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(3, 512) for _ in range(45)]
    expected = hf_prompt_logprobs(tiny_llama, prompt)
    # Chunks of at most 16 tokens; four blocks of 8 cannot hold two 45-token prompts at once: the second preempts.
    # The torch attention path (cpu_kernels=False): which logits get scored does not depend on the C++ kernels.
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_num_batched_tokens=16, block_size=8, num_kv_blocks=8,
              preemption_mode="recompute", cpu_kernels=False)
    plain = SamplingParams(temperature=0, max_tokens=2)
    warm, again = (llm.generate([prompt], plain, use_tqdm=False)[0] for _ in range(2))
    assert warm.prompt_logprobs is None  # not asked for
    assert again.num_cached_tokens > 0  # the cache holds the prompt now
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    first, second = llm.generate([prompt, prompt[:40]], params, use_tqdm=False)
    assert first.num_cached_tokens == 0  # the cache held the prompt; a request asking for its log-probs computes it
    assert llm.engine.scheduler.counters.preemptions["recompute"] > 0

    for output, length in ((first, 45), (second, 40)):
        scored = output.prompt_logprobs
        assert scored is not None and len(scored) == length and scored[0] is None
        for position in range(1, length):
            entry, row = scored[position], expected[position - 1]
            assert entry is not None
            token = prompt[position]
            assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
            top_values, top_ids = row.topk(2)
            for token_id, value in zip(top_ids.tolist(), top_values.tolist()):
                assert entry[token_id] == pytest.approx(value, abs=1e-4)
            assert set(entry) <= {token, *top_ids.tolist()}
