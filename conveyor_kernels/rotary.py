"""Rotary position embedding, Llama / GPT-NeoX "rotate_half" convention, applied in place.

Dimension i of the first half of head_dim rotates with dimension i of the second half by the angle
positions[t] * inv_freq[i] (not interleaved pairs as in GPT-J). `cos_cache` / `sin_cache` hold
cos and sin of those angles, `[max_position, head_dim / 2]` in float32; the rotation is computed in
float32 and rounded once to q/k's dtype.
"""

from __future__ import annotations

import torch

from conveyor_kernels.triton_utils import next_power_of_2, require_triton, tl, triton


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_token,
    stride_head,
    num_heads,
    half_dim,
    cos,
    sin,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotates every head of one token of x ([T, heads, head_dim]) in place."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    first_half = x_ptr + token * stride_token + heads[:, None] * stride_head + dims[None, :]
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half_dim)
    first = tl.load(first_half, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(first_half + half_dim, mask=mask, other=0.0).to(tl.float32)
    rotated_first = first * cos[None, :] - second * sin[None, :]
    rotated_second = second * cos[None, :] + first * sin[None, :]
    tl.store(first_half, rotated_first.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first_half + half_dim, rotated_second.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_stride_token,
    q_stride_head,
    k_stride_token,
    k_stride_head,
    cache_stride,
    num_heads,
    num_kv_heads,
    half_dim,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """One program per token: q and k heads share the token's cos/sin row."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < half_dim
    cos = tl.load(cos_ptr + position * cache_stride + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * cache_stride + dims, mask=dim_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, q_stride_token, q_stride_head, num_heads, half_dim, cos, sin, Q_HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr, token, k_stride_token, k_stride_head, num_kv_heads, half_dim, cos, sin, K_HEADS_PAD, HALF_PAD)


def apply_rotary(
    q: torch.Tensor,  # [T, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], rotated in place
    positions: torch.Tensor,  # [T] int64 (or int32)
    cos_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
    sin_cache: torch.Tensor,  # [max_position, head_dim / 2] float32
) -> None:
    """Triton launcher. q and k may be strided views (slices of a fused qkv projection) as long as
    head_dim is contiguous."""
    require_triton()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half_dim = head_dim // 2
    if k.shape != (num_tokens, num_kv_heads, head_dim) or positions.shape != (num_tokens,):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    if head_dim % 2 != 0 or cos_cache.shape[1] != half_dim or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin caches {tuple(cos_cache.shape)} do not fit head_dim {head_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_cache.stride() != sin_cache.stride() or cos_cache.stride(-1) != 1:
        raise ValueError("head_dim of q/k and rows of the cos/sin caches must be contiguous")
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_cache,
        sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_cache.stride(0),
        num_heads,
        num_kv_heads,
        half_dim,
        Q_HEADS_PAD=next_power_of_2(num_heads),
        K_HEADS_PAD=next_power_of_2(num_kv_heads),
        HALF_PAD=next_power_of_2(half_dim),
        num_warps=4,
    )


def apply_rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Plain-torch `apply_rotary`, in place like it."""
    cos = cos_cache[positions.long()].float().unsqueeze(1)  # [T, 1, head_dim / 2]
    sin = sin_cache[positions.long()].float().unsqueeze(1)
    for x in (q, k):
        first, second = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1))
