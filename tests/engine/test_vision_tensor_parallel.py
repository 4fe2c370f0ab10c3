"""Tensor parallelism with images: the text decoder sharded over two gloo ranks on the CPU, the vision encoder whole on
each, every rank encoding the images of the step data it receives. Greedy float32 output equals transformers'
`generate` with the folder's processor, token for token and log-prob within 1e-4, for each family (LLaVA-1.5, Qwen2.5-VL
with M-RoPE grid positions, Gemma 3 with bidirectional image spans), image lines batched with a text line, under
chunked prefill, swap or recompute preemption and the prefix cache, then with n = 2. Each family reuses its own vision
test's conversations and transformers oracle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
import torch

from bench.vision_models import qwen_processor
from engine import LLM, SamplingParams
from engine.outputs import RequestOutput
from tests.engine import test_qwen2_5_vl, test_vision_gemma3, test_vision_models

pytestmark = pytest.mark.slow

Runs = list[tuple[list[int], list[float]]]  # per conversation: transformers' greedy tokens and their log-probs


def qwen_generate(folder: Path, conversations: list[list[dict]]) -> Runs:
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = qwen_processor(folder)
    return [test_qwen2_5_vl.hf_generate(processor, model, conversation) for conversation in conversations]


@dataclass(frozen=True)
class Family:
    tests: ModuleType  # the family's own vision tests: CONVERSATIONS (three image lines and a text line), MAX_TOKENS
    hf_generate: Callable[[Path, list[list[dict]]], Runs]
    # Few KV blocks (preemption) and a small step budget: chunks end inside LLaVA's and Qwen2.5-VL's images (Gemma 3's
    # are computed whole, so its budget holds one image's 16 placeholders).
    options: dict[str, object] = field(default_factory=dict)


FAMILIES = {
    "llava_folder": Family(
        test_vision_models, test_vision_models.hf_generate,
        {"max_num_batched_tokens": 8, "num_kv_blocks": 16, "preemption_mode": "swap"},
    ),
    "qwen2_5_vl_folder": Family(
        test_qwen2_5_vl, qwen_generate,
        {"max_num_batched_tokens": 8, "num_kv_blocks": 20, "preemption_mode": "recompute"},
    ),
    "gemma3_folder": Family(
        test_vision_gemma3, test_vision_gemma3.hf_generate,
        {"max_num_batched_tokens": 24, "num_kv_blocks": 18, "preemption_mode": "swap"},
    ),
}


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, n=n, logprobs=0)


def assert_equal_to_hf(outputs: list[RequestOutput], runs: Runs) -> None:
    assert [[sample.token_ids for sample in output.outputs] for output in outputs] == [
        [tokens] * len(output.outputs) for output, (tokens, _) in zip(outputs, runs)
    ]
    for output, (_, hf_logprobs) in zip(outputs, runs):
        for sample in output.outputs:
            ours = [step[token] for step, token in zip(sample.logprobs, sample.token_ids)]
            assert ours == pytest.approx(hf_logprobs, abs=1e-4)


@pytest.mark.parametrize("fixture", sorted(FAMILIES))
def test_tp2_image_lines_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    family = FAMILIES[fixture]
    folder: Path = request.getfixturevalue(fixture)
    conversations, max_tokens = family.tests.CONVERSATIONS, family.tests.MAX_TOKENS
    runs = family.hf_generate(folder, conversations)
    mode = family.options["preemption_mode"]
    llm = LLM(
        str(folder), dtype="float32", device="cpu", tensor_parallel_size=2, block_size=4, max_num_seqs=4,
        enable_prefix_caching=True, swap_space=64 * 1024**2, **family.options,
    )
    try:
        assert_equal_to_hf(llm.chat(conversations, greedy(max_tokens), use_tqdm=False), runs)
        stats = llm.engine.stats()
        assert stats.preemptions.get(mode, 0) > 0
        assert stats.prefix_cache_hit_tokens > 0  # found again: a shared prompt start or image, a recomputed prompt
        # Three distinct images: chunks and recomputed prompts found theirs in the encoder cache (rank 0's; the
        # other rank's ran the same steps).
        assert stats.images_encoded == 3 and stats.encoder_cache_hits >= 1
        assert stats.kv_blocks_used == 0 and stats.host_blocks_used == 0
        [forked] = llm.chat(conversations[1:2], greedy(max_tokens, n=2), use_tqdm=False)
        assert_equal_to_hf([forked], runs[1:2])
    finally:
        llm.engine.close()


def test_the_text_decoder_widths_must_divide(llava_folder: Path) -> None:
    """What tensor parallelism refuses of a vision-language model is its text decoder's (4 heads here), before any rank
    starts; the encoder, whole on every rank, has no width to divide."""
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(str(llava_folder), dtype="float32", device="cpu", tensor_parallel_size=3)
