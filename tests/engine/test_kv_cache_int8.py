"""The int8 KV cache (`kv_cache_dtype="int8"`, CPU): what it holds, how close its output stays to the
unquantized cache's, and that block moves keep it exact.

- Capacity: one budget holds 2 * head_dim / (head_dim + 4) times the bf16 blocks (the 4 bytes are each row's
  float32 scale), 4 * head_dim / (head_dim + 4) times the float32 blocks.
- Accuracy, SmolLM2 in float32 over 10 chat prompts, 20 greedy tokens each: >= 95% of the tokens equal the
  unquantized cache's (compared position by position up to each output's first difference, a difference counting
  every position after it as lost), and where both runs chose the same token after the same prefix its log-prob
  differs by at most LOGPROB_TOLERANCE.
- Exactness: swap preemption, prefix caching and chunked prefill read back exactly the int8 values a plain run
  attends (a prefill's own new K/V are attended as quantized too), so their greedy tokens equal the plain int8
  run's, token for token.
- Refusals: int8 on the Triton backend, fp8_e4m3 (not implemented), an unknown name.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import bytes_per_block, num_kv_blocks, resolve_kv_cache_dtype
from tests.conftest import save_random_hf_model
from tests.engine.test_hf_equivalence import ENGINE_SETUPS, QUESTIONS, check_setup_exercised

# Largest |log-prob difference| of a token both runs chose after the same prefix (measured: 0.07 at most).
LOGPROB_TOLERANCE = 0.25
MAX_TOKENS = 20


def test_the_same_budget_holds_about_twice_the_bf16_blocks():
    model = ModelConfig(  # SmolLM2-135M's attention shape
        architecture="LlamaForCausalLM", vocab_size=100, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=1e5, rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True,
        attention_bias=False, qk_norm=False, eos_token_ids=(2,), bos_token_id=1,
    )
    config = EngineConfig(kv_cache_memory=1 << 30, block_size=16)
    bf16 = num_kv_blocks(model, config, torch.bfloat16, None)
    int8 = num_kv_blocks(model, config, torch.int8, None)
    assert bytes_per_block(model, 16, torch.bfloat16) / bytes_per_block(model, 16, torch.int8) == 2 * 64 / 68
    assert int8 / bf16 == pytest.approx(2 * 64 / 68, rel=1e-3)  # 1.88x
    assert num_kv_blocks(model, config, torch.float32, None) * 4 * 64 / 68 == pytest.approx(int8, rel=1e-3)


def _greedy(llm: LLM, prompts, logprobs: bool = False):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0 if logprobs else None)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_smollm2_int8_cache_agrees_with_the_unquantized_cache(smollm2_folder):
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(smollm2_folder)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    runs = {
        kv_cache_dtype: _greedy(
            LLM(model=str(smollm2_folder), dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype), prompts, True
        )
        for kv_cache_dtype in ("auto", "int8")
    }
    agreed = total = 0
    worst = 0.0
    for reference, quantized in zip(runs["auto"], runs["int8"]):
        total += len(reference.token_ids)
        for position, (expected, got) in enumerate(zip(reference.token_ids, quantized.token_ids)):
            if expected != got:
                break
            agreed += 1
            worst = max(worst, abs(reference.logprobs[position][expected] - quantized.logprobs[position][got]))
    assert agreed / total >= 0.95, f"{agreed} of {total} greedy tokens agree"
    assert worst <= LOGPROB_TOLERANCE


@pytest.fixture(scope="module")
def tiny_int8_case(tmp_path_factory):
    folder = save_random_hf_model("llama", tmp_path_factory.mktemp("llama"))
    rng = random.Random(3)
    shared_prefix = [rng.randrange(3, 512) for _ in range(37)]  # so the prefix cache has hits to serve
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(16)]
    prompts = [shared_prefix + p if i % 2 else p for i, p in enumerate(prompts)]
    plain = LLM(
        model=str(folder), dtype="float32", device="cpu", kv_cache_dtype="int8", enable_prefix_caching=False,
        max_num_batched_tokens=4096,
    )
    return str(folder), prompts, [o.token_ids for o in _greedy(plain, prompts)]


@pytest.mark.parametrize("setup", ["preemption_swap", "prefix_caching", "chunked_prefill"])
def test_block_moves_read_back_the_same_int8_values(tiny_int8_case, setup):
    folder, prompts, expected = tiny_int8_case
    llm = LLM(model=folder, dtype="float32", device="cpu", kv_cache_dtype="int8", **ENGINE_SETUPS[setup])
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
    assert [o.token_ids for o in _greedy(llm, prompts)] == expected
    check_setup_exercised(llm, setup)


def test_a_kv_cache_dtype_the_device_cannot_run_is_refused():
    with pytest.raises(ValueError, match="'int8' runs on the CPU"):
        resolve_kv_cache_dtype("int8", torch.bfloat16, "triton")
    with pytest.raises(ValueError, match="'fp8_e4m3' .* not implemented"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, "triton")
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="int4")  # type: ignore[arg-type]
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "torch") == torch.bfloat16
