"""The int8 KV cache's rows: each (token, kv head) row of K or V is head_dim int8 values followed by their
float32 scale in 4 more bytes, so a cache of `[num_blocks, block_size, kv_heads, head_dim + 4]` int8 carries its
scales inside its blocks.

Why inline and per (token, head): the scale is dynamic (amax / 127 of the row it scales, computed when the row is
written), the most accurate choice for int8, and it needs no calibration. Stored inside the block, it moves with
the block wherever blocks move (swap to the host pool and back, copy-on-write, a prefix-cache hit), with no second
pool to keep in step. It costs 4 bytes per head_dim values: bf16 -> int8 holds 2 * head_dim / (head_dim + 4) times
the tokens (1.88x at head_dim 64, 1.94x at 128).

Rounding is to nearest (ties to even), symmetric over [-127, 127]; an all-zero row gets scale 0 and dequantizes to
zeros. The C++ decode attention (cpu_kernels.cpp, `widen_row<int8_t>`) dequantizes exactly as `dequantize` does
(value x scale in float32), before rounding to the query's dtype where torch rounds.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 after each row's head_dim values


def row_width(head_dim: int) -> int:
    """Elements (bytes) of one (token, kv head) row of an int8 cache."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[.., head_dim] float rows -> [.., head_dim + 4] int8 rows with their scales (contiguous)."""
    rows = x.float()
    scale = rows.abs().amax(dim=-1, keepdim=True) / 127.0
    values = torch.where(scale > 0, rows / scale, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([values, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[.., head_dim + 4] int8 rows -> [.., head_dim] in `dtype`: value x scale in float32, then rounded."""
    head_dim = packed.shape[-1] - SCALE_BYTES
    scale = packed[..., head_dim:].contiguous().view(torch.float32)
    return (packed[..., :head_dim].float() * scale).to(dtype)
