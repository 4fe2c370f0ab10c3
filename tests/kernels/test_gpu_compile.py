"""The interpreter runs kernels as numpy code, so it cannot catch what only the GPU compiler
rejects (loop-carried type changes, tl.dot shape rules, shared memory overflows). Here every kernel
is compiled ahead of time for an H100 (sm_90) down to a cubin, which needs Triton's bundled NVIDIA
toolchain but no GPU. It runs in a subprocess because this one has TRITON_INTERPRET set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels.triton_utils import TRITON_AVAILABLE

_PROGRAM = """
import os

os.environ.pop("TRITON_INTERPRET", None)

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import activation, block_copy, decode_attention, kv_cache_write, prefill_attention, rmsnorm, rotary

TARGET = GPUTarget("cuda", 90, 32)


def compile_for_gpu(kernel, types, constexprs, num_warps=4):
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    triton.compile(ASTSource(kernel, signature, constexprs), target=TARGET, options={"num_warps": num_warps})


for dtype in ("bf16", "fp32"):
    attention_types = {name: "*" + dtype for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    attention_types.update(
        block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", scale_log2="fp32",
        partial_out_ptr="*fp32", partial_max_ptr="*fp32", partial_sum_ptr="*fp32",
    )
    block_n = 64 if dtype == "bf16" else 32
    for single_split in (True, False):
        compile_for_gpu(
            decode_attention._decode_partition_kernel,
            attention_types,
            dict(BLOCK_SIZE=16, BLOCK_N=block_n, GROUP_PAD=16, HEAD_DIM_PAD=128, SINGLE_SPLIT=single_split,
                 DOT_IN_FP32=dtype == "fp32"),
        )
    compile_for_gpu(
        prefill_attention._prefill_attention_kernel,
        attention_types,
        dict(BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=block_n, HEAD_DIM_PAD=128, DOT_IN_FP32=dtype == "fp32"),
    )
compile_for_gpu(
    decode_attention._decode_merge_kernel,
    {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_max_ptr": "*fp32", "partial_sum_ptr": "*fp32"},
    dict(SPLITS_PAD=8, HEAD_DIM_PAD=128),
)
compile_for_gpu(
    kv_cache_write._write_kv_cache_kernel,
    {name: "*bf16" for name in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")} | {"slot_mapping_ptr": "*i64"},
    dict(HEADS_PAD=8, HEAD_DIM_PAD=128),
)
compile_for_gpu(
    rmsnorm._rms_norm_kernel,
    {name: "*bf16" for name in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr")} | {"eps": "fp32"},
    dict(BLOCK=4096, HAS_RESIDUAL=True),
    num_warps=8,
)
compile_for_gpu(
    rotary._rotary_kernel,
    {"q_ptr": "*bf16", "k_ptr": "*bf16", "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
    dict(Q_HEADS_PAD=32, K_HEADS_PAD=8, HALF_PAD=64),
)
compile_for_gpu(activation._silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"}, dict(BLOCK=1024))
compile_for_gpu(
    block_copy._copy_blocks_kernel,
    {"src_addresses_ptr": "*i64", "dst_addresses_ptr": "*i64", "pairs_ptr": "*i64"},
    dict(WORD=tl.int16, CHUNK=2048),
)
"""


def _nvidia_backend_present() -> bool:
    if not TRITON_AVAILABLE:
        return False
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(not _nvidia_backend_present(), reason="needs Triton with its NVIDIA backend")
def test_every_kernel_compiles_for_sm90() -> None:
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", _PROGRAM], cwd=repo_root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
