"""Paged decode attention: one new query token per sequence, attending to its whole cached context.

Flash-decoding: each sequence's context is cut into `num_splits` partitions handled by separate
programs, so a batch of a few long sequences still spreads over every SM. A partition program
keeps an online softmax (running max, running sum, unnormalized output) over its keys; a second
kernel merges the partitions. One program serves all query heads of one kv head (GQA), so each
K/V tile is loaded once for the whole group and the group's scores come from one tl.dot.

Layout: see conveyor_kernels/kv_cache_write.py. `seq_lens[b]` counts the context including the new token,
which is already in the cache. With a sliding window only the last `window` positions are split and
read (earlier blocks may be freed); soft-capping (Gemma 2) caps the scores before the softmax.
"""

from __future__ import annotations

import math

import torch

from conveyor_kernels.kv_quant import is_quantized, row_width
from conveyor_kernels.prefill_attention import prefill_attention_reference
from conveyor_kernels.triton_utils import (
    dot_in_fp32,
    key_tile_length,
    load_kv_tile,
    matmul,
    multiprocessor_count,
    next_power_of_2,
    require_triton,
    soft_cap,
    tl,
    triton,
)

# A partition shorter than this many key tiles costs more in the merge than it wins in parallelism.
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 32


# Arguments that change from step to step (outside CUDA graphs): specialising on them would only
# multiply compiles.
@triton.jit(do_not_specialize=["num_splits", "block_tables_stride"])
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    scale_log2,
    window,
    softcap_log2,
    num_splits,
    num_heads,
    group_size,
    head_dim,
    q_stride_seq,
    q_stride_head,
    out_stride_seq,
    out_stride_head,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    block_tables_stride,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Program (sequence, kv head, split): attention of the kv head's query group over one
    partition of the attended context (the last `window` positions when window > 0). Scores are
    kept in log2 units (scale folded with log2(e)) so the softmax uses exp2. With SINGLE_SPLIT the
    result goes straight to `out`; otherwise the unnormalized output, max and sum go to the partial
    buffers for the merge kernel."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = 0
    if window > 0:
        kv_start = tl.maximum(seq_len - window, 0)
    num_tiles = tl.cdiv(seq_len - kv_start, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    split_start = kv_start + split * tiles_per_split * BLOCK_N
    split_end = tl.minimum(split_start + tiles_per_split * BLOCK_N, seq_len)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * group_size + group
    head_mask = group < group_size
    dim_mask = dims < head_dim
    seq64 = seq.to(tl.int64)
    q = tl.load(
        q_ptr + seq64 * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq64 * block_tables_stride
    for tile_start in range(split_start, split_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = positions < split_end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table, positions, valid, kv_head, dims, dim_mask,
            cache_stride_block, cache_stride_offset, cache_stride_head, q, head_dim, BLOCK_SIZE, QUANTIZED,
        )

        scores = matmul(q, tl.trans(k), DOT_IN_FP32) * scale_log2
        if SOFTCAP:  # capping commutes with the change of units when the cap changes units too
            scores = soft_cap(scores, softcap_log2)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Every tile holds at least one valid key, so new_max is finite and alpha well defined.
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        alpha = tl.exp2(running_max - new_max)
        running_sum = running_sum * alpha + tl.sum(probs, 1)
        acc = acc * alpha[:, None] + matmul(probs, v, DOT_IN_FP32)
        running_max = new_max

    out_mask = head_mask[:, None] & dim_mask[None, :]
    if SINGLE_SPLIT:
        # An empty context (seq_len 0, e.g. a padding entry) yields zeros instead of 0/0.
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            out_ptr + seq64 * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Empty partitions store max -inf and sum 0, which the merge weighs to nothing.
        rows = (seq64 * num_heads + heads) * num_splits + split
        tl.store(partial_max_ptr + rows, running_max, mask=head_mask)
        tl.store(partial_sum_ptr + rows, running_sum, mask=head_mask)
        tl.store(partial_out_ptr + rows[:, None] * head_dim + dims[None, :], acc, mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    num_splits,
    num_heads,
    head_dim,
    out_stride_seq,
    out_stride_head,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """Program (sequence, head): rescales each partition to the global max and normalizes."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < num_splits
    dim_mask = dims < head_dim

    rows = (seq * num_heads + head) * num_splits + splits
    partial_max = tl.load(partial_max_ptr + rows, mask=split_mask, other=float("-inf"))
    partial_sum = tl.load(partial_sum_ptr + rows, mask=split_mask, other=0.0)
    partial_out = tl.load(
        partial_out_ptr + rows[:, None] * head_dim + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    global_max = tl.max(partial_max, 0)
    # All partitions empty (seq_len 0): keep the arithmetic finite; the output comes out zero.
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)
    weights = tl.exp2(partial_max - global_max)
    total = tl.sum(weights * partial_sum, 0)
    out = tl.sum(weights[:, None] * partial_out, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * out_stride_seq + head * out_stride_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def _default_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Enough partitions for about two programs per SM, without partitions so short that the
    merge outweighs them. `max_context` is the block table's capacity, an upper bound known on
    the host, so choosing needs no device sync (and stays fixed under CUDA graph capture)."""
    wanted = -(-2 * multiprocessor_count(device) // (batch * num_kv_heads))
    useful = -(-max_context // (block_n * _MIN_TILES_PER_SPLIT))
    return max(1, min(wanted, useful, _MAX_SPLITS))


def table_widths_per_variant(
    num_kv_heads: int, head_dim: int, element_size: int, block_size: int, max_blocks: int, device: torch.device
) -> list[int]:
    """One block-table width per kernel variant (one partition, or the merge's padded partition
    count) that a decode step of one sequence launches with, tables 1..max_blocks wide. Larger
    batches split less, into counts one sequence also reaches, so a warm-up running these widths
    compiles every decode variant."""
    block_n = key_tile_length(head_dim, element_size)
    first_of_variant: dict[int, int] = {}
    for width in range(1, max_blocks + 1):
        splits = _default_num_splits(1, num_kv_heads, width * block_size, block_n, device)
        first_of_variant.setdefault(next_power_of_2(splits), width)
    return list(first_of_variant.values())


def decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new token
    scale: float,
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim]
    num_splits: int | None = None,
    window: int | None = None,  # sliding window: each row attends its last `window` positions
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
) -> torch.Tensor:
    """Triton launcher. `num_splits` partitions per sequence (default: see `_default_num_splits`);
    with one partition the merge kernel is skipped. A sequence with seq_len 0 gets zeros."""
    require_triton()
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    quantized = is_quantized(k_cache.dtype)  # rows of head_dim fp8 values and their scale (conveyor_kernels/kv_quant.py)
    if cache_head_dim != (row_width(head_dim) if quantized else head_dim) or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} vs batch {batch}"
        )
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1 or out.stride(-1) != 1 or k_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("head_dim (and the block table rows) must be contiguous")
    if batch == 0:
        return out

    group_size = num_heads // num_kv_heads
    head_dim_pad = next_power_of_2(head_dim)
    block_n = key_tile_length(head_dim, q.element_size())  # K/V tiles are held in q's dtype
    if num_splits is None:
        num_splits = _default_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, block_n, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {num_splits}")

    single_split = num_splits == 1
    if single_split:
        # Never touched: the kernel writes to `out` directly. Any float32 tensor fills the slots.
        partial_out = partial_max = partial_sum = out.new_empty(0, dtype=torch.float32)
    else:
        partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)

    _decode_partition_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_max,
        partial_sum,
        scale * math.log2(math.e),
        window or 0,
        (softcap or 1.0) * math.log2(math.e),
        num_splits,
        num_heads,
        group_size,
        head_dim,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        # tl.dot needs at least 16 rows; the padding rows are masked query heads.
        GROUP_PAD=max(16, next_power_of_2(group_size)),
        HEAD_DIM_PAD=head_dim_pad,
        SINGLE_SPLIT=single_split,
        DOT_IN_FP32=dot_in_fp32(q.dtype),
        SOFTCAP=softcap is not None,
        QUANTIZED=quantized,
        num_warps=4,
    )
    if not single_split:
        _decode_merge_kernel[(batch, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            num_splits,
            num_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            SPLITS_PAD=next_power_of_2(num_splits),
            HEAD_DIM_PAD=head_dim_pad,
            num_warps=4,
        )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain-torch `decode_attention`: prefill attention with one query row per sequence."""
    batch = q.shape[0]
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return prefill_attention_reference(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, window=window, softcap=softcap
    )
