"""The quantized KV cache's rows: each (token, kv head) row of K or V is head_dim quantized values (int8 on the CPU,
fp8 e4m3 on CUDA) followed by their float32 scale in 4 more bytes, so a cache of
`[num_blocks, block_size, kv_heads, head_dim + 4]` carries its scales inside its blocks.

Why inline and per (token, head): the scale is dynamic (amax / the type's largest value, over the row it scales,
computed when the row is written), the most accurate choice for 8 bits, and needs no calibration. Stored inside the
block, it moves with the block wherever blocks move (swap to the host pool and back, copy-on-write, a prefix-cache
hit), with no second pool to keep in step. It costs 4 bytes per head_dim values: bf16 -> 8 bits holds
2 * head_dim / (head_dim + 4) times the tokens (1.88x at head_dim 64, 1.94x at 128).

int8: rounded to nearest (ties to even), symmetric over [-127, 127]. fp8 e4m3: the scaled value cast to
float8_e4m3fn (round to nearest, |x| <= 448). An all-zero row gets scale 0 and dequantizes to zeros. The portable
C++ decode attention (cpu_decode_attention.cpp, `widen_row<int8_t>`), the C++ prefill attention (to bf16, as
`dequantize(rows, torch.bfloat16)`) and the Triton kernels (`load_kv_tile`, `write_kv_cache`) dequantize / quantize
exactly as this module does (value x scale in float32); the AVX-512 / AVX2 decode attention (vector_decode.cpp)
multiplies a row's dot product with the query by its K scale and a probability by its V scale instead, the same
sums of int8 x scale products up to float32 rounding order.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 after each row's head_dim values
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
_LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def largest(dtype: torch.dtype) -> float:
    """The largest magnitude a row's values are scaled to."""
    return _LARGEST[dtype]


def row_width(head_dim: int) -> int:
    """Elements (bytes) of one (token, kv head) row of a quantized cache."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[.., head_dim] float rows -> [.., head_dim + 4] rows of `dtype` (int8 or float8_e4m3fn) with their scales."""
    rows = x.float()
    scale = rows.abs().amax(dim=-1, keepdim=True) / _LARGEST[dtype]
    scaled = rows / torch.where(scale > 0, scale, 1.0)  # an all-zero row (scale 0) stays 0
    values = scaled.round_().clamp_(-127, 127).to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return torch.cat([values, scale.contiguous().view(dtype)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[.., head_dim + 4] quantized rows -> [.., head_dim] in `dtype`: value x scale in float32, then rounded."""
    head_dim = packed.shape[-1] - SCALE_BYTES
    scale = packed[..., head_dim:].contiguous().view(torch.float32)
    return (packed[..., :head_dim].float() * scale).to(dtype)
