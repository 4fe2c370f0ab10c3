"""Paged prefill / extend attention for chunked prefill, varlen, in one launch.

The batch is flat: sequence i owns query rows `[query_start_loc[i], query_start_loc[i+1])` of q, and
`seq_lens[i]` counts its whole context including this chunk, whose K/V are already in the cache.
Query row j of a q_len-row chunk sits at position seq_len - q_len + j and attends causally to cache
positions [0, that position]; every key, cached prefix and new chunk alike, is read through the
block table.

Work is cut into query tiles of BLOCK_Q tokens of one sequence, numbered across the batch without
padding: sequence i's tiles start at `query_start_loc[i] // BLOCK_Q + i`, so the grid needs only
`T // BLOCK_Q + B` tiles whatever the mix of lengths (a program finds its sequence by binary search;
the few tiles past a sequence's end exit at once). A tile's rows are its BLOCK_Q tokens times the
query heads of one kv head (GQA), so each K/V tile is loaded once for the whole group.

With a sliding window a query at position p attends keys in (p - window, p] only, and a tile reads
keys from its first query's window on (earlier blocks may be freed); soft-capping (Gemma 2) caps the
scores before the softmax. `key_limits` (Gemma 3's images, whose tokens attend to each other both ways)
gives each query token the first key position it does not see instead of p + 1: an image token's is its
image's end, within the chunk; the window still applies.

Layout: see conveyor_kernels/kv_cache_write.py.
"""

from __future__ import annotations

import math

import torch

from conveyor_kernels.kv_quant import is_quantized, row_width
from conveyor_kernels.paged_attention import paged_attention_reference
from conveyor_kernels.triton_utils import (
    dot_in_fp32,
    interpreter_enabled,
    key_tile_length,
    load_kv_tile,
    matmul,
    next_power_of_2,
    require_triton,
    soft_cap,
    tl,
    triton,
)


# Arguments that change from step to step: specialising on them (== 1, divisible by 16) would only
# multiply compiles, each one a second or more inside a running engine.
@triton.jit(do_not_specialize=["num_seqs", "block_q", "block_tables_stride", "key_limits_ptr", "has_key_limits"])
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    key_limits_ptr,
    has_key_limits,
    scale_log2,
    window,
    softcap_log2,
    num_seqs,
    group_size,
    head_dim,
    block_q,
    q_stride_token,
    q_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    block_tables_stride,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Program (query tile, kv head). Row r of the tile is token r // group_size of the tile and
    query head kv_head * group_size + r % group_size; block_q = BLOCK_M // group_size."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The last sequence whose first tile is at or before this one.
    low = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        if tl.load(query_start_loc_ptr + middle) // block_q + middle <= tile:
            low = middle + 1
        else:
            high = middle
    seq = low - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_query = (tile - (q_start // block_q + seq)) * block_q
    if first_query >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim
    query_index = first_query + rows // group_size
    heads = kv_head * group_size + rows % group_size
    row_valid = (rows < block_q * group_size) & (query_index < q_len)
    query_positions = context_len + query_index
    tokens = (q_start + query_index).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * q_stride_token + heads[:, None] * q_stride_head + dims[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    )

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    # Keys from the tile's first query's window to its last query position (or the furthest key limit);
    # the causal mask (or the limits) and the window trim the rest per row.
    kv_end = context_len + tl.minimum(first_query + block_q, q_len)
    limits = query_positions + 1
    if has_key_limits:  # a runtime branch: no second compile of the kernel
        limits = tl.load(key_limits_ptr + tokens, mask=row_valid, other=0)
        kv_end = tl.maximum(kv_end, tl.max(limits, 0))
    kv_start = 0
    if window > 0:
        kv_start = tl.maximum(context_len + first_query - window + 1, 0)
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        key_positions = tile_start + tl.arange(0, BLOCK_N)
        key_valid = key_positions < kv_end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table, key_positions, key_valid, kv_head, dims, dim_mask,
            cache_stride_block, cache_stride_offset, cache_stride_head, q, head_dim, BLOCK_SIZE, QUANTIZED,
        )

        scores = matmul(q, tl.trans(k), DOT_IN_FP32) * scale_log2
        if SOFTCAP:  # in log2 units, with the cap in log2 units too
            scores = soft_cap(scores, softcap_log2)
        visible = key_valid[None, :] & (key_positions[None, :] < limits[:, None])
        if window > 0:
            visible = visible & (key_positions[None, :] > query_positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # Under a window a row may see nothing in the tile (nor before it): its max stays -inf,
        # which must not meet -inf - -inf. Without one, key 0 is visible to every row.
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        alpha = tl.exp2(running_max - safe_max)
        running_sum = running_sum * alpha + tl.sum(probs, 1)
        acc = acc * alpha[:, None] + matmul(probs, v, DOT_IN_FP32)
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + tokens[:, None] * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_mask[None, :],
    )


def _tile_rows(group_size: int, max_query_len: int) -> int:
    """BLOCK_M: tall enough for the longest chunk's queries times the group, up to a cap (64 on
    a GPU, 32 under the interpreter to keep it quick), and at least 16 for tl.dot."""
    cap = 32 if interpreter_enabled() else 64
    wanted = min(cap, max(16, next_power_of_2(max_query_len * group_size)))
    return max(wanted, next_power_of_2(group_size))


def chunk_lengths_per_tile(num_heads: int, num_kv_heads: int, max_query_len: int) -> list[int]:
    """One chunk length (the shortest) per query-tile height that steps whose longest chunk has
    2..max_query_len tokens launch with: a warm-up running these compiles every prefill variant."""
    group_size = num_heads // num_kv_heads
    first_of_tile: dict[int, int] = {}
    for query_len in range(2, max_query_len + 1):
        first_of_tile.setdefault(_tile_rows(group_size, query_len), query_len)
    return list(first_of_tile.values())


def prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including this chunk
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
    window: int | None = None,  # sliding window: a query at position p attends keys in (p - window, p]
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    key_limits: torch.Tensor | None = None,  # [T] int32: each query's first unseen key position; None: p + 1
) -> torch.Tensor:
    """Triton launcher. `max_query_len` (the longest chunk, known on the host) sizes the query
    tiles, so a batch of short chunks does not pay for tall tiles. Rows of q past
    query_start_loc[-1] are not written."""
    require_triton()
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    quantized = is_quantized(k_cache.dtype)  # rows of head_dim fp8 values and their scale (conveyor_kernels/kv_quant.py)
    if cache_head_dim != (row_width(head_dim) if quantized else head_dim) or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)} / block_tables {tuple(block_tables.shape)}"
            f" vs {num_seqs} sequences"
        )
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1 or out.stride(-1) != 1 or k_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("head_dim (and the block table rows) must be contiguous")
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out

    group_size = num_heads // num_kv_heads
    block_m = _tile_rows(group_size, max_query_len)
    block_q = block_m // group_size
    block_n = key_tile_length(head_dim, q.element_size())  # K/V tiles are held in q's dtype
    num_tiles = num_tokens // block_q + num_seqs
    _prefill_attention_kernel[(num_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        key_limits if key_limits is not None else seq_lens,  # not read without limits
        int(key_limits is not None),
        scale * math.log2(math.e),
        window or 0,
        (softcap or 1.0) * math.log2(math.e),
        num_seqs,
        group_size,
        head_dim,
        block_q,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        DOT_IN_FP32=dot_in_fp32(q.dtype),
        SOFTCAP=softcap is not None,
        QUANTIZED=quantized,
        num_warps=4,
    )
    return out


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    bidirectional_spans: tuple[tuple[int, int, int], ...] = (),
) -> torch.Tensor:
    """Plain-torch `prefill_attention` (its `key_limits` given as the spans they come from): the engine's torch paged attention, run in float32 so the
    oracle is more precise than the bf16 kernel it checks (a quantized cache's rows dequantized to float32, where
    the kernel rounds them to q's dtype). Rows of q past query_start_loc[-1] come back uninitialized."""
    if not is_quantized(k_cache.dtype):
        k_cache, v_cache = k_cache.float(), v_cache.float()
    out = paged_attention_reference(
        q.float(), k_cache, v_cache, query_start_loc.tolist(), seq_lens.tolist(), block_tables,
        scale, window=window, softcap=softcap, bidirectional_spans=bidirectional_spans,
    )
    return out.to(q.dtype)
