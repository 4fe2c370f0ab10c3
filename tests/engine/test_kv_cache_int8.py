"""The int8 KV cache (`kv_cache_dtype="int8"`, CPU): what it holds, how close its output stays to the
unquantized cache's, and that block moves keep it exact.

- Capacity: one budget holds 2 * head_dim / (head_dim + 4) times the bf16 blocks (the 4 bytes are each row's
  float32 scale), 4 * head_dim / (head_dim + 4) times the float32 blocks.
- Accuracy, SmolLM2 in float32 over 10 chat prompts, 20 greedy tokens each, teacher-forced: >= 95% of the
  int8 cache's greedy choices equal the unquantized cache's, and the log-prob of the unquantized run's token differs
  by at most LOGPROB_TOLERANCE.
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

# Largest |log-prob difference| of the unquantized run's greedy token under the two caches (measured: 0.246, at
# positions where the top two tokens are close; 277 of the 281 greedy choices agree).
LOGPROB_TOLERANCE = 0.5
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
    """Teacher-forced: the unquantized cache's greedy continuations are scored by the int8-cache engine (prompt
    log-probs over prompt + continuation, one prefill, which attends the int8 K/V as decoding would); at every
    continuation position its top token must be the unquantized run's greedy token on >= 95% of the positions, and
    the log-prob it gives that token within LOGPROB_TOLERANCE of the unquantized run's. (Free-running, one early
    difference changes the whole rest of an output: over these prompts 221 of 281 tokens come before any difference.)"""
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(smollm2_folder)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    folder = str(smollm2_folder)
    reference = _greedy(LLM(model=folder, dtype="float32", device="cpu"), prompts, logprobs=True)
    int8 = LLM(model=folder, dtype="float32", device="cpu", kv_cache_dtype="int8")
    scored = int8.generate(
        [p + r.token_ids for p, r in zip(prompts, reference)],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    agreed = total = 0
    worst = 0.0
    for prompt, expected, output in zip(prompts, reference, scored):
        for position, token in enumerate(expected.token_ids):
            ranked = output.prompt_logprobs[len(prompt) + position]
            agreed += max(ranked, key=ranked.get) == token
            total += 1
            worst = max(worst, abs(ranked[token] - expected.logprobs[position][token]))
    assert agreed / total >= 0.95, f"{agreed} of {total} greedy tokens agree"
    assert worst <= LOGPROB_TOLERANCE, f"log-probs differ by up to {worst}"


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
