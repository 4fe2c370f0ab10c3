"""What the Triton kernel modules share: the optional `triton` import and launch-time helpers.

Triton is an optional dependency, so every kernel module imports `triton` and `tl` from here.
Without Triton they are stand-ins that let the modules (and their torch references) import; a
Triton launcher then fails with an ImportError on its first line, through `require_triton`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:

    class _TritonStandIn:
        """Enough of `triton` / `triton.language` for kernel definitions to be evaluated:
        `@triton.jit` (with or without options) leaves the function as it is (it is never
        launched, since launchers call `require_triton` first) and attributes such as
        `tl.constexpr` in annotations are None."""

        @staticmethod
        def jit(fn: Any = None, **options: Any) -> Any:
            return fn if fn is not None else (lambda function: function)

        def __getattr__(self, name: str) -> None:
            return None

    triton = _TritonStandIn()  # type: ignore[assignment]
    tl = _TritonStandIn()  # type: ignore[assignment]
    TRITON_AVAILABLE = False


def require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise ImportError("this kernel needs Triton (`pip install conveyor[triton]`); use its *_reference instead")


def interpreter_enabled() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1), which is
    how the kernels are tested on machines without a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands should be upcast to float32 (then multiplied in full IEEE precision).

    Always under the interpreter: it multiplies bf16 operands as their raw uint16 bit patterns, so
    a bf16 tl.dot returns garbage there. On a GPU only for float32 inputs, where the default TF32
    would cost precision that a float32 cache was chosen to keep.
    """
    return interpreter_enabled() or dtype == torch.float32


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill; 1 off CUDA (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def key_tile_length(head_dim: int, element_size: int) -> int:
    """Keys per attention tile (BLOCK_N): 64 while a key row takes at most 256 bytes (bf16 up to
    head_dim 128), else 32, so the pipelined K/V tiles stay within the shared memory of GPUs
    smaller than an H100; 16 under the interpreter, where small tiles keep tests quick."""
    if interpreter_enabled():
        return 16
    return 64 if head_dim * element_size <= 256 else 32


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def matmul(a, b, IN_FP32: tl.constexpr):
    """a @ b accumulated in float32. With IN_FP32 (see `dot_in_fp32`) both operands are upcast and
    multiplied exactly; otherwise `a` is cast to b's dtype (how attention feeds its float32
    probabilities to the tensor cores alongside bf16 values)."""
    if IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def soft_cap(scores, softcap):
    """softcap * tanh(scores / softcap), with tanh from exp (which every Triton backend has): it
    saturates to +-1 where exp overflows or vanishes."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table,
    positions,
    valid,
    kv_head,
    dims,
    dim_mask,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    q,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """K and V at context `positions` of one sequence ([tile, head_dim] each), read through its
    block table; rows where `valid` is False load zeros. A QUANTIZED cache's rows (conveyor_kernels/kv_quant.py: head_dim
    fp8 values, then their float32 scale) are dequantized in float32 and rounded to q's dtype."""
    block_ids = tl.load(block_table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    token_offsets = (
        block_ids * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_offset + kv_head * cache_stride_head
    )
    kv_offsets = token_offsets[:, None] + dims[None, :]
    kv_mask = valid[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if QUANTIZED:
        k_scale = tl.load((k_cache_ptr + token_offsets + head_dim).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
        v_scale = tl.load((v_cache_ptr + token_offsets + head_dim).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
        k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
        v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
    return k, v
