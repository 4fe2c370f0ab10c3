"""Writing a step's new K/V rows into the paged cache.

Cache layout, per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V. Token t
goes to the flat slot `slot_mapping[t] = block_id * block_size + offset`; slot -1 marks a padding
token whose K/V are dropped. An fp8 cache's rows are `head_dim + 4` wide: each (token, kv head) row is
quantized as it is written, with its float32 scale after it (conveyor_kernels/kv_quant.py).
"""

from __future__ import annotations

import torch

from conveyor_kernels import kv_quant
from conveyor_kernels.triton_utils import next_power_of_2, require_triton, tl, triton


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    block_size,
    num_kv_heads,
    head_dim,
    LARGEST,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """One program per token: all of its kv heads at once. QUANTIZED: each head's row scaled by amax / LARGEST
    into the cache's fp8 type, the scale stored after the row."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    cache_offsets = (
        (slot // block_size) * cache_stride_block
        + (slot % block_size) * cache_stride_offset
        + heads[:, None] * cache_stride_head
        + dims[None, :]
    )
    token64 = token.to(tl.int64)
    key = tl.load(key_ptr + token64 * key_stride_token + heads[:, None] * key_stride_head + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + token64 * value_stride_token + heads[:, None] * value_stride_head + dims[None, :], mask=mask
    )
    if QUANTIZED:
        row_offsets = (
            (slot // block_size) * cache_stride_block + (slot % block_size) * cache_stride_offset
            + heads * cache_stride_head + head_dim
        )
        head_mask = heads < num_kv_heads
        key = key.to(tl.float32)
        value = value.to(tl.float32)
        k_scale = tl.max(tl.where(mask, tl.abs(key), 0.0), 1) / LARGEST
        v_scale = tl.max(tl.where(mask, tl.abs(value), 0.0), 1) / LARGEST
        # An all-zero row (scale 0) divides by 1: its values stay 0.
        key = key / tl.where(k_scale > 0, k_scale, 1.0)[:, None]
        value = value / tl.where(v_scale > 0, v_scale, 1.0)[:, None]
        tl.store((k_cache_ptr + row_offsets).to(tl.pointer_type(tl.float32)), k_scale, mask=head_mask)
        tl.store((v_cache_ptr + row_offsets).to(tl.pointer_type(tl.float32)), v_scale, mask=head_mask)
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 (or int32), -1 = skip
) -> None:
    """Triton launcher: copies each token's K/V into its cache slot, casting to the cache dtype.
    key/value may be strided views (e.g. slices of a fused qkv projection) as long as head_dim is
    contiguous."""
    require_triton()
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, slots {tuple(slot_mapping.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    quantized = kv_quant.is_quantized(k_cache.dtype)
    if quantized and k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the Triton KV write quantizes to float8_e4m3fn only, not {k_cache.dtype}")
    if k_cache.shape[2:] != (num_kv_heads, kv_quant.row_width(head_dim) if quantized else head_dim):
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold [{num_kv_heads}, {head_dim}] rows")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dimension of key, value and the caches")
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        kv_quant.largest(k_cache.dtype) if quantized else 1.0,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        QUANTIZED=quantized,
    )


def write_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch `write_kv_cache`: the engine's CPU path. Into a quantized cache, rows of head_dim are quantized
    first (conveyor_kernels/kv_quant.py); rows already quantized (head_dim + 4 wide) are copied as they are."""
    if kv_quant.is_quantized(k_cache.dtype) and key.shape[-1] != k_cache.shape[-1]:
        key, value = kv_quant.quantize(key, k_cache.dtype), kv_quant.quantize(value, v_cache.dtype)
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # padding slots are rare; skip the masked copies when there are none
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    if k_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel on CPU: copied as bytes
        key, value, k_cache, v_cache = (t.view(torch.uint8) for t in (key, value, k_cache, v_cache))
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), value)
