"""C++ kernels for the CPU path (`cpu_kernels.cpp`), built on first use.

Decode on a CPU is bound by memory bandwidth, and torch's composite ops pass over the data several
times: the paged decode attention here reads K/V once straight through the block tables (the torch
path gathers a padded copy first: three passes), with an online softmax per block and all query
heads of a kv head at a time; the RMSNorm fuses the residual add and the float32 statistics into one
pass per row. Their oracles are `paged_attention_reference` and the model's torch RMSNorm.

The extension compiles with torch's cpp_extension (ninja + the system C++ compiler) into
`$TORCH_EXTENSIONS_DIR`, once per machine and source version. Where it cannot be built,
`load_cpu_kernels()` returns None and the engine keeps the torch path.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")


@cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None where it cannot be built (no compiler, no ninja)."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name="conveyor_cpu_kernels",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # any build failure means: use the torch path
        log.warning("CPU kernels unavailable, using the torch path: %s", error)
        return None


def _kernels() -> ModuleType:
    kernels = load_cpu_kernels()
    if kernels is None:
        raise RuntimeError("the CPU kernels could not be built")
    return kernels


def paged_decode_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]; head_dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length of each decode row
    token_index: torch.Tensor,  # [B] int64: the query row of each decode sequence
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim] contiguous: rows in token_index are written
) -> None:
    _kernels().paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, token_index, out, scale)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (+ residual, which is then updated in place to x + residual)."""
    return _kernels().rms_norm(x, residual, weight, eps)
