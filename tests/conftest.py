"""Shared fixtures: the real SmolLM2 (converted once per cache dir) and tiny random HF checkpoints."""

from __future__ import annotations

import functools
import gc
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Under pytest-xdist (`-n`), each worker process runs its own tests beside the other workers': one thread each, here and
# in the processes its tests start (OMP_NUM_THREADS is inherited), or two workers' thread pools on two cores spin
# against each other (measured: the HF oracle's fixture 3.8x slower than alone).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after OMP_NUM_THREADS: torch reads it once, at import)

if TYPE_CHECKING:
    from engine import LLM

# The real service's fixtures (SeaweedFS, PostgreSQL, Redis, API and worker processes) import boto3, SQLAlchemy,
# pydantic-settings and Redis: tests/api and tests/jobs load them from their own conftest.py, so engine and
# kernel tests collect on a machine that has none of these (a lent GPU).
SERVICE_FIXTURES = ("tests.service_fixtures", "tests.stack_fixtures")


def register_service_fixtures(config: pytest.Config) -> None:
    """Registers the service fixtures as plugins, once per session however many folders ask: session-scoped
    fixtures (one SeaweedFS, one scratch database) stay shared. Called from a folder's `pytest_configure`,
    which pytest runs when it loads that folder's conftest.py, before collecting the folder's tests."""
    for plugin in SERVICE_FIXTURES:
        config.pluginmanager.import_plugin(plugin)

@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The CPU this run took its time on, at the end of the run's output where CI's record shows it: the suite's time
    is a figure per CPU kind (README, "Tests")."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return
    fields = {line.split(":")[0].strip(): line.partition(":")[2].strip() for line in lines[:64]}
    flags = set(fields.get("flags", "").split())
    kind = ("AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags
            else "AVX-512" if "avx512f" in flags else "AVX2-only" if "avx2" in flags else "no AVX2")
    terminalreporter.write_line(f"CPU: {fields.get('model name', 'unknown')} ({kind}), {os.cpu_count()} cores")


# Triton decides between compiling and interpreting when a kernel module is imported, and engine
# tests import kernels first: without a GPU, interpret.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Share of the GPU's memory each CUDA test's engine may fill (its `gpu_memory_utilization`; the engine's own
# default, 0.9, leaves nothing for the next test's engine). From CONVEYOR_TEST_GPU_MEMORY_FRACTION, default 0.3.
TEST_GPU_MEMORY_FRACTION = float(os.environ.get("CONVEYOR_TEST_GPU_MEMORY_FRACTION", "0.3"))


@pytest.fixture
def cuda_llm() -> Iterator[Callable[..., LLM]]:
    """Builds engines on CUDA with TEST_GPU_MEMORY_FRACTION of the GPU's memory; they are closed when the test
    ends, and `free_gpu_memory_after_cuda_tests` frees their memory, whether the test passed or failed."""
    from engine import LLM

    built: list[LLM] = []

    def build(model: str, **options: object) -> LLM:
        llm = LLM(model=model, device="cuda", gpu_memory_utilization=TEST_GPU_MEMORY_FRACTION, **options)
        built.append(llm)
        return llm

    yield build
    for llm in built:
        llm.engine.close()
    built.clear()


@pytest.fixture(autouse=True)
def free_gpu_memory_after_cuda_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a `cuda` test, gives its GPU memory back. A failed test's traceback (kept in sys.last_traceback for
    post-mortem debugging) holds its frames, and so its engine and KV cache: cleared first, or every later engine
    test would find the memory taken and fail on a negative KV budget."""
    yield
    if request.node.get_closest_marker("cuda") is None:
        return
    failed = getattr(sys, "last_traceback", None)
    if failed is not None:
        traceback.clear_frames(failed)
        for frame, _ in traceback.walk_tb(failed):
            # pytest keeps the traceback elsewhere too (its report's ExceptionInfo), and writing the report read
            # the frames' locals into a dict that frame.clear() leaves behind (Python 3.11, 3.12).
            if isinstance(frame.f_locals, dict):
                frame.f_locals.clear()
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    from engine.model_registry import DEFAULT_MODEL, resolve_model

    source = resolve_model(DEFAULT_MODEL)
    assert source.path is not None
    return source.path


@pytest.fixture(scope="session")
def llava_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA-1.5 folder saved by transformers (bench/vision_models.py), built once per session."""
    from bench.vision_models import make_llava

    return make_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="session")
def qwen2_5_vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL folder saved by transformers (bench/vision_models.py), built once per session."""
    from bench.vision_models import make_qwen2_5_vl

    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="session")
def gemma3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Gemma 3 vision-language folder saved by transformers (bench/vision_models.py), built once per
    session."""
    from bench.vision_models import make_gemma3

    return make_gemma3(tmp_path_factory.mktemp("gemma3"))


@functools.cache
def hf_smollm2(dtype: torch.dtype = torch.float32):
    """transformers' SmolLM2, read from the bundled GGUF file itself (dequantized by gguf-py to `dtype`): the
    oracle of the engine's runs of it (the converted folder keeps quantized blocks only this engine reads). Read
    once per session and dtype (each read takes 15-25 s on 2 cores: transformers converts the file's tokenizer and
    tensors) and shared: a caller that changes the model (peft wrapping it) takes a `copy.deepcopy` of it."""
    import transformers

    from engine.model_registry import DEFAULT_MODEL, transformers_source

    path, arguments = transformers_source(DEFAULT_MODEL)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **arguments).eval()


@pytest.fixture
def tiny_dummy_model(tmp_path: Path) -> Path:
    """A config-only folder of a tiny Qwen3 (q/k norms, explicit head_dim), for load_format="dummy"."""
    import json

    config = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


# Sliding window of the windowed tiny checkpoints, in tokens: test prompts run past it.
TINY_WINDOW = 12
# LongRoPE's pretraining context of the tiny "phi3-longrope" checkpoint: test prompts start, end and cross it.
TINY_LONG_ROPE_THRESHOLD = 32


def save_random_hf_model(kind: str, folder: Path) -> Path:
    """A small random checkpoint saved by transformers itself (the oracle's own format): Llama, Qwen2,
    Qwen3, or a windowed family (window TINY_WINDOW): "mistral", "qwen2-window" (the second layer
    windowed), "phi3", "gemma2" (alternating, soft-capped), "gemma3" (one global layer in two, q/k norms,
    local RoPE base), "phi3-longrope" (LongRoPE beyond TINY_LONG_ROPE_THRESHOLD tokens, no window), or a mixture of
    experts: "mixtral", "qwen2_moe" (shared expert, a dense layer),
    "qwen3_moe" (every second layer sparse)."""
    import transformers

    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model_cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":  # q/k/v projections with bias
        config = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        model_cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
        model_cls = transformers.Qwen3ForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=TINY_WINDOW, rope_theta=10000.0)
        model_cls = transformers.MistralForCausalLM
    elif kind == "qwen2-window":
        config = transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1, rope_theta=10000.0
        )
        model_cls = transformers.Qwen2ForCausalLM
    elif kind == "phi3":
        config = transformers.Phi3Config(**common, sliding_window=TINY_WINDOW, pad_token_id=0, rope_theta=10000.0)
        model_cls = transformers.Phi3ForCausalLM
    elif kind == "phi3-longrope":  # factors far apart, so a sequence rotated with the wrong ones goes astray
        half = common["hidden_size"] // common["num_attention_heads"] // 2
        config = transformers.Phi3Config(
            **common, original_max_position_embeddings=TINY_LONG_ROPE_THRESHOLD, pad_token_id=0, rope_theta=10000.0,
            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(half)],
                          "long_factor": [1.0 + 2.0 * i for i in range(half)]},
        )
        model_cls = transformers.Phi3ForCausalLM
    elif kind == "gemma2":
        config = transformers.Gemma2Config(
            **{**common, "tie_word_embeddings": True}, head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
            attn_logit_softcapping=2.0, final_logit_softcapping=6.0, pad_token_id=0,
        )
        model_cls = transformers.Gemma2ForCausalLM
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(
            **{**common, "tie_word_embeddings": True}, head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
            sliding_window_pattern=2, rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            }, pad_token_id=0,
        )
        model_cls = transformers.Gemma3ForCausalLM
    elif kind == "mixtral":  # every layer sparse, top-2 renormalised
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0)
        model_cls = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":  # a shared expert, top-k not renormalised, layer 1 dense
        config = transformers.Qwen2MoeConfig(
            **common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=96, mlp_only_layers=[1], rope_theta=1000000.0,
        )
        model_cls = transformers.Qwen2MoeForCausalLM
    elif kind == "qwen3_moe":  # q/k norms, renormalised top-k, every second layer sparse
        config = transformers.Qwen3MoeConfig(
            **common, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
            norm_topk_prob=True, decoder_sparse_step=2, rope_theta=1000000.0,
        )
        model_cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = model_cls(config).float()
    with torch.no_grad():  # peaked logits: greedy decisions should not hinge on float rounding
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
            elif kind.startswith("gemma"):  # Gemma's norms scale by (1 + weight): make the offset matter
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
