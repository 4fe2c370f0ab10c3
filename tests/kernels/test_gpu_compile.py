"""The interpreter runs kernels as numpy code, so it cannot catch what only the GPU compiler
rejects (loop-carried type changes, tl.dot shape rules, shared memory overflows). Here every kernel
variant the engine launches is compiled ahead of time for an H100 (sm_90) down to a cubin, which
needs Triton's bundled NVIDIA toolchain but no GPU, and each must fit an H100's shared memory.

The variants are the real ones: the engine's warm-up (which runs every variant a step can launch)
drives a model of each shape on the meta device, with the H100's 132 SMs for the decode split
choice, and each launch is recorded with Triton's own specialisation rules (integers equal to 1
or divisible by 16, pointer alignment; not the do_not_specialize arguments) instead of being run.
It runs in a subprocess because this one has TRITON_INTERPRET set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor_kernels.triton_utils import TRITON_AVAILABLE

H100_SHARED_MEMORY_PER_BLOCK = 227 * 1024  # of 228 KB per SM; 1 KB is reserved per block
SHAPES = (("llama-3-8b", "bfloat16"), ("qwen2-0.5b", "bfloat16"), ("qwen3-0.6b", "float32"), ("qwen3-30b-a3b", "bfloat16"))

_PROGRAM = """
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from engine.attention import TritonAttention
from engine.config import ModelConfig
from engine.dtypes import building_on
from engine.kv_cache import allocate_kv_cache
from engine.model_registry import DUMMY_SHAPES
from engine.model_runner import ModelRunner
from engine.models import MODEL_CLASSES
from conveyor_kernels import decode_attention

TARGET = GPUTarget("cuda", 90, 32)
H100_SMS = 132
launches = {}


def record(kernel, *args, grid, warmup, **kwargs):
    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize, True)
        if kind == "constexpr":  # an integer equal to 1 becomes a constant
            signature[param.name], constexprs[param.name] = "constexpr", spec
            continue
        signature[param.name] = kind
        if spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    key = repr((kernel.fn.__name__, signature, constexprs, attrs, sorted(options.items())))
    launches.setdefault(key, (kernel, signature, constexprs, attrs, options))


JITFunction.run = record
decode_attention.multiprocessor_count = lambda device: H100_SMS

meta = torch.device("meta")
for shape, dtype_name in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype_name)
    config = ModelConfig.from_hf(DUMMY_SHAPES[shape])
    with building_on(meta, dtype):
        model = MODEL_CLASSES[config.architecture](config, TritonAttention(), "triton")
    block_size = 16
    runner = ModelRunner(model, allocate_kv_cache(config, 1024, block_size, dtype, meta), [], block_size, meta, "triton")
    runner.warm_up(8192, -(-config.max_position_embeddings // block_size))

results = []
for kernel, signature, constexprs, attrs, options in launches.values():
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options)
    described = {k: v if isinstance(v, (int, bool)) else str(v) for k, v in constexprs.items()}
    results.append({"kernel": kernel.fn.__name__, "constexprs": described, "shared": compiled.metadata.shared})
print(json.dumps(results))
"""


def _nvidia_backend_present() -> bool:
    if not TRITON_AVAILABLE:
        return False
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_backend_present(), reason="needs Triton with its NVIDIA backend")
def test_every_launched_variant_compiles_for_sm90_within_shared_memory() -> None:
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _PROGRAM, json.dumps(SHAPES)], cwd=repo_root, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    variants = json.loads(result.stdout.strip().splitlines()[-1])

    too_big = [v for v in variants if v["shared"] > H100_SHARED_MEMORY_PER_BLOCK]
    assert too_big == []
    kernels = {v["kernel"] for v in variants}
    assert kernels == {
        "_prefill_attention_kernel", "_decode_partition_kernel", "_decode_merge_kernel", "_write_kv_cache_kernel",
        "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_copy_blocks_kernel", "_expert_matmul_kernel",
    }
    # Every query-tile height (16, 32 and 64 rows for a group of 4), one and several partitions,
    # and the merge's padded partition counts up to the cap.
    prefill_tiles = {v["constexprs"]["BLOCK_M"] for v in variants if v["kernel"] == "_prefill_attention_kernel"}
    assert prefill_tiles == {16, 32, 64}
    assert {v["constexprs"]["SINGLE_SPLIT"] for v in variants if v["kernel"] == "_decode_partition_kernel"} == {True, False}
    merge_pads = {v["constexprs"]["SPLITS_PAD"] for v in variants if v["kernel"] == "_decode_merge_kernel"}
    assert merge_pads == {2, 4, 8, 16, 32}
