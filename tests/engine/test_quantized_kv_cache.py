"""The quantized KV cache (`kv_cache_dtype`: "int8" on the CPU, "fp8_e4m3" on CUDA): what it holds, how close
its output stays to the unquantized cache's, and that block moves keep it exact.

- Capacity: one budget holds 2 * head_dim / (head_dim + 4) times the bf16 blocks (the 4 bytes are each row's
  float32 scale), 4 * head_dim / (head_dim + 4) times the float32 blocks.
- Accuracy, SmolLM2 in float32 over 10 chat prompts, up to 20 greedy tokens each, teacher-forced: the unquantized
  cache's greedy continuations are scored by the quantized-cache engine (prompt log-probs over prompt +
  continuation: one prefill, which attends the quantized K/V as decoding would); >= 95% of its top tokens equal the
  unquantized run's, and the log-prob it gives those tokens is within LOGPROB_TOLERANCE of the unquantized run's.
  (Free-running, one early difference changes the rest of an output: with int8, over all 16 QUESTIONS, 221 of the
  281 tokens come before their output's first difference, where teacher-forced 277 of 281 agree.)
- Exactness: swap preemption and prefix caching read back exactly the quantized values a plain run attends (a
  prefill's own new K/V are attended as quantized too), so their greedy tokens equal the plain quantized run's.
- Refusals: a kv_cache_dtype the backend cannot run (int8 on Triton, fp8 on the torch CPU path), an unknown name.
The fp8 cases need a GPU (its kernels are checked under Triton's interpreter in tests/kernels/test_kv_quant.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import bytes_per_block, num_kv_blocks, resolve_kv_cache_dtype
from tests.conftest import save_random_hf_model
from tests.engine.hf_oracle import SMOLLM2_QUESTIONS as QUESTIONS
from tests.engine.test_hf_equivalence import ENGINE_SETUPS, check_setup_exercised

# Largest |log-prob difference| of the unquantized run's greedy token under the two caches (int8, measured: 0.235,
# where the top two tokens are close; 174 of the 177 greedy choices agree).
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
    for quantized in (torch.int8, torch.float8_e4m3fn):
        assert bytes_per_block(model, 16, torch.bfloat16) / bytes_per_block(model, 16, quantized) == 2 * 64 / 68
        assert num_kv_blocks(model, config, quantized, None) / bf16 == pytest.approx(2 * 64 / 68, rel=1e-3)  # 1.88x
    assert num_kv_blocks(model, config, torch.float32, None) * 4 * 64 / 68 == pytest.approx(
        num_kv_blocks(model, config, torch.int8, None), rel=1e-3
    )


def _greedy(llm: LLM, prompts, logprobs: bool = False):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0 if logprobs else None)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def check_agreement(smollm2_folder, build: Callable[..., LLM], kv_cache_dtype: str) -> None:
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(smollm2_folder)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS[:10]
    ]
    reference = _greedy(build(str(smollm2_folder), dtype="float32"), prompts, logprobs=True)
    quantized = build(str(smollm2_folder), dtype="float32", kv_cache_dtype=kv_cache_dtype)
    scored = quantized.generate(
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


def test_smollm2_int8_cache_agrees_with_the_unquantized_cache(smollm2_folder):
    check_agreement(smollm2_folder, cpu_llm, "int8")


@pytest.fixture(scope="module")
def random_case(tmp_path_factory) -> tuple[str, list[list[int]]]:
    folder = str(save_random_hf_model("llama", tmp_path_factory.mktemp("llama")))
    rng = random.Random(3)
    shared_prefix = [rng.randrange(3, 512) for _ in range(37)]  # so the prefix cache has hits to serve
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(16)]
    return folder, [shared_prefix + p if i % 2 else p for i, p in enumerate(prompts)]


def plain_run(build: Callable[..., LLM], random_case, kv_cache_dtype: str) -> list[list[int]]:
    """The quantized cache without block moves: no prefix caching, a pool and a step that hold every prompt."""
    folder, prompts = random_case
    llm = build(folder, dtype="float32", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
                max_num_batched_tokens=4096)
    return [o.token_ids for o in _greedy(llm, prompts)]


def check_block_moves(build: Callable[..., LLM], random_case, kv_cache_dtype: str, setup: str, expected) -> None:
    folder, prompts = random_case
    llm = build(folder, dtype="float32", kv_cache_dtype=kv_cache_dtype, **ENGINE_SETUPS[setup])
    assert llm.engine.runner.kv_caches[0][0].dtype == resolve_kv_cache_dtype(
        kv_cache_dtype, torch.float32, llm.engine.kernel_backend
    )
    assert [o.token_ids for o in _greedy(llm, prompts)] == expected
    check_setup_exercised(llm, setup)


def cpu_llm(model: str, **options: object) -> LLM:
    return LLM(model=model, device="cpu", **options)


@pytest.fixture(scope="module")
def int8_plain(random_case) -> list[list[int]]:
    return plain_run(cpu_llm, random_case, "int8")


@pytest.mark.parametrize("setup", ["preemption_swap", "prefix_caching"])
def test_int8_block_moves_read_back_the_same_values(random_case, int8_plain, setup):
    check_block_moves(cpu_llm, random_case, "int8", setup, int8_plain)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("setup", ["preemption_swap", "prefix_caching"])
def test_fp8_block_moves_read_back_the_same_values(random_case, setup, cuda_llm):
    check_block_moves(cuda_llm, random_case, "fp8_e4m3", setup, plain_run(cuda_llm, random_case, "fp8_e4m3"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_smollm2_fp8_cache_agrees_with_the_unquantized_cache(smollm2_folder, cuda_llm):
    check_agreement(smollm2_folder, cuda_llm, "fp8_e4m3")


def test_a_kv_cache_dtype_the_backend_cannot_run_is_refused(tiny_dummy_model):
    with pytest.raises(ValueError, match="'int8' runs on the CPU"):
        resolve_kv_cache_dtype("int8", torch.bfloat16, "triton")
    with pytest.raises(ValueError, match="'fp8_e4m3' runs on CUDA"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, "torch")
    with pytest.raises(ValueError, match="'fp8_e4m3' runs on CUDA"):
        LLM(model=str(tiny_dummy_model), load_format="dummy", device="cpu", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="int4")  # type: ignore[arg-type]
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, "triton") == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "torch") == torch.bfloat16
