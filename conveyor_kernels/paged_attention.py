"""Paged attention in plain torch: the CPU path of the engine and the oracle for the Triton kernels.

Cache layout, per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V (an int8 cache:
`head_dim + 4` int8 per row, the values and their scale, conveyor_kernels/kv_quant.py, dequantized as blocks are read). A batch is
flat ("varlen"): sequence i owns query rows `[query_start_loc[i], query_start_loc[i+1])`, and its
`seq_lens[i]` counts every token in its context including the new ones, which are already written
to the cache. New token j of a sequence with q_len new tokens sits at position seq_len - q_len + j
and attends to cache positions 0..that position.

The batch layout is the same for every layer, so it is turned into a `PagedAttentionPlan` (index
tensors, masks, groupings) once per step and each layer only gathers and attends.

With a sliding window (a query at position p attends keys in (p - window, p]) each row reads only
the blocks its window touches, from the first such block on: blocks before it may already have been
freed (their table entries are then -1) and are never read.

Decode rows whose block tables start with the same blocks (chunks of one prefix-cached document, the
n samples of a prompt, beams) can be attended as a `SharedPrefixGroup`: the shared blocks' K/V are
read once for every row of the group, each row's own remaining blocks separately, and the two softmax
parts merged by their log-sum-exp. Decode is memory-bound on CPU, so a group of g rows over a long
shared prefix reads about 1/g of the K/V it otherwise would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from conveyor_kernels import kv_quant
from conveyor_kernels.cpu_kernels import paged_decode_attention, paged_prefill_attention

_BUCKET_FILL = 0.8  # a decode group's shortest context is at least this share of its longest
# Rows per decode group: small enough that a group's gathered K/V stay in the CPU's caches until
# attention reads them (measured: 64 rows in groups of 16 run 2.2x faster than one group of 64).
_MAX_GROUP_ROWS = 16


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token rows of similar context length, attended in one padded call."""

    token_index: torch.Tensor  # [b] query rows
    blocks: torch.Tensor  # [b * width] block ids: each row's blocks from its first attended one, padded to width
    mask: torch.Tensor  # [b, 1, 1, width * block_size] bool: True where the row attends


@dataclass(frozen=True)
class PrefillRow:
    """A sequence with several new tokens (a prefill chunk)."""

    rows: slice  # its query rows
    blocks: torch.Tensor  # the block ids covering its attended context, from the first attended block
    first_key: int  # position of the first key those blocks hold (a multiple of the block size)
    seq_len: int
    # [q_len, seq_len - first_key] when a cached prefix precedes the chunk or a window cuts it; None: causal
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeBatch:
    """All single-token rows, for the CPU decode kernel, which reads the block tables itself."""

    token_index: torch.Tensor  # [b] int64 query rows
    block_tables: torch.Tensor  # [b, max_blocks] int32
    seq_lens: torch.Tensor  # [b] int32
    window: int | None  # sliding window in tokens


@dataclass(frozen=True)
class PrefillBatch:
    """All multi-token rows, for the CPU prefill kernel, which reads the block tables itself."""

    query_starts: torch.Tensor  # [b] int64: sequence i's chunk is query rows query_starts[i]..query_ends[i]
    query_ends: torch.Tensor  # [b] int64
    block_tables: torch.Tensor  # [b, max_blocks] int32
    seq_lens: torch.Tensor  # [b] int32
    window: int | None  # sliding window in tokens


@dataclass(frozen=True)
class SharedPrefixGroup:
    """Decode rows whose tables share their first blocks; every row's context extends past them."""

    token_index: torch.Tensor  # [g] query rows
    prefix_blocks: torch.Tensor  # [P] the shared blocks, all full
    suffix_blocks: torch.Tensor  # [g * S] each row's blocks after the prefix, padded to S
    suffix_mask: torch.Tensor  # [g, 1, 1, S * block_size] bool: True where the row's context is real


@dataclass(frozen=True)
class PagedAttentionPlan:
    decode_groups: tuple[DecodeGroup, ...]  # the torch path's decode rows
    decode_batch: DecodeBatch | None  # the kernel path's decode rows (then decode_groups is empty)
    prefill_rows: tuple[PrefillRow, ...]  # the torch path's prefill chunks
    shared_prefix_groups: tuple[SharedPrefixGroup, ...] = ()
    prefill_batch: PrefillBatch | None = None  # the kernel path's prefill chunks (then prefill_rows is empty)


def plan_paged_attention(
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: torch.Tensor,
    block_size: int,
    use_decode_kernel: bool = False,
    shared_prefix_min_saved_tokens: int = 0,
    window: int | None = None,
    use_prefill_kernel: bool = False,
    bidirectional_spans: Sequence[tuple[int, int, int]] = (),
) -> PagedAttentionPlan:
    """`use_decode_kernel` / `use_prefill_kernel`: single-token rows / prefill chunks go to the CPU kernels.
    Decode rows sharing cached blocks are attended as `SharedPrefixGroup`s where that saves reading
    at least `shared_prefix_min_saved_tokens` tokens' K/V ((rows - 1) x shared tokens); 0: never (and
    never with a `window`, whose rows share no attended prefix). `bidirectional_spans`: (sequence, start, stop)
    position ranges whose queries also attend to the span's later keys (transformers' Gemma 3 image mask: a
    query at p attends key k when k <= p or both are in one span, and, with a window, k > p - window); each
    span ends within its sequence's chunk, and is for the torch prefill rows only (not `use_prefill_kernel`)."""
    if window is not None:
        shared_prefix_min_saved_tokens = 0
    device = block_tables.device
    starts, lens = list(query_start_loc), list(seq_lens)
    query_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decode_rows = [i for i, q_len in enumerate(query_lens) if q_len == 1]
    shared_groups: list[SharedPrefixGroup] = []
    if shared_prefix_min_saved_tokens > 0 and len(decode_rows) > 1:
        shared_groups, decode_rows = _shared_prefix_groups(
            decode_rows, starts, lens, block_tables, block_size, shared_prefix_min_saved_tokens
        )

    decode_batch = None
    if use_decode_kernel and decode_rows:
        rows = torch.tensor(decode_rows, device=device)
        decode_batch = DecodeBatch(
            token_index=torch.tensor([starts[i] for i in decode_rows], device=device),
            block_tables=block_tables[rows].contiguous(),
            seq_lens=torch.tensor([lens[i] for i in decode_rows], dtype=torch.int32, device=device),
            window=window,
        )
        decode_rows = []

    def first_block(first_query: int) -> int:
        """The block holding the first key that a query at `first_query` or later attends."""
        return 0 if window is None else max(0, first_query - window + 1) // block_size

    decode_groups = []
    for rows in _length_buckets(decode_rows, lens):
        firsts = [first_block(lens[i] - 1) for i in rows]
        width = max(-(-lens[i] // block_size) - first for i, first in zip(rows, firsts))
        columns = torch.tensor(firsts, device=device)[:, None] + torch.arange(width, device=device)[None, :]
        # Columns past a row's table are padding (masked); clamping keeps them inside the tensor.
        columns = columns.clamp_(max=block_tables.shape[1] - 1)
        row_index = torch.tensor(rows, device=device)
        key_positions = (
            torch.tensor(firsts, device=device)[:, None] * block_size
            + torch.arange(width * block_size, device=device)[None, :]
        )
        context_lens = torch.tensor([lens[i] for i in rows], device=device)[:, None]
        mask = key_positions < context_lens
        if window is not None:
            mask &= key_positions > context_lens - 1 - window
        decode_groups.append(
            DecodeGroup(
                token_index=torch.tensor([starts[i] for i in rows], device=device),
                blocks=block_tables[row_index[:, None], columns].flatten(),
                mask=mask[:, None, None, :],
            )
        )

    prefill_batch = None
    prefill_seqs = [i for i, q_len in enumerate(query_lens) if q_len > 1]
    if use_prefill_kernel and prefill_seqs:
        prefill_batch = PrefillBatch(
            query_starts=torch.tensor([starts[i] for i in prefill_seqs], device=device),
            query_ends=torch.tensor([starts[i + 1] for i in prefill_seqs], device=device),
            block_tables=block_tables[torch.tensor(prefill_seqs, device=device)].contiguous(),
            seq_lens=torch.tensor([lens[i] for i in prefill_seqs], dtype=torch.int32, device=device),
            window=window,
        )
        prefill_seqs = []

    spans: dict[int, list[tuple[int, int]]] = {}
    for i, start, stop in bidirectional_spans:
        spans.setdefault(i, []).append((start, stop))
    prefill_rows = []
    for i in prefill_seqs:
        q_len = query_lens[i]
        seq_len = lens[i]
        first = first_block(seq_len - q_len) * block_size
        mask = None
        if q_len != seq_len or (window is not None and window < q_len) or i in spans:
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
            key_pos = torch.arange(first, seq_len, device=device)[None, :]
            mask = key_pos <= query_pos
            for start, stop in spans.get(i, ()):
                mask |= (query_pos >= start) & (query_pos < stop) & (key_pos >= start) & (key_pos < stop)
            if window is not None:
                mask &= key_pos > query_pos - window
        prefill_rows.append(
            PrefillRow(
                slice(starts[i], starts[i + 1]),
                block_tables[i, first // block_size : -(-seq_len // block_size)],
                first,
                seq_len,
                mask,
            )
        )
    return PagedAttentionPlan(
        tuple(decode_groups), decode_batch, tuple(prefill_rows), tuple(shared_groups), prefill_batch
    )


def _shared_prefix_groups(
    rows: list[int],
    starts: list[int],
    lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    min_saved_tokens: int,
) -> tuple[list[SharedPrefixGroup], list[int]]:
    """(the groups, the decode rows left over). The rows' tables form a trie; each row joins the
    deepest shared prefix whose group saves enough reads: rows of one document share the whole
    document, although every prompt (of every document) starts with the same chat template. A
    prefix only covers blocks before each member's newest token, so every row keeps a suffix."""
    tables = dict(zip(rows, block_tables[rows].tolist()))
    full_blocks = {row: (lens[row] - 1) // block_size for row in rows}
    found: list[tuple[list[int], int]] = []  # (members, shared blocks)

    def place(members: list[int], depth: int) -> list[int]:
        """Groups what it can of `members`, which share their first `depth` blocks; returns the rest."""
        while all(full_blocks[row] > depth for row in members) and len({tables[row][depth] for row in members}) == 1:
            depth += 1
        unplaced = [row for row in members if full_blocks[row] <= depth]
        branches: dict[int, list[int]] = {}
        for row in members:
            if full_blocks[row] > depth:
                branches.setdefault(tables[row][depth], []).append(row)
        for branch in branches.values():
            unplaced += place(branch, depth + 1) if len(branch) > 1 else branch
        if (len(unplaced) - 1) * depth * block_size >= min_saved_tokens:
            found.append((sorted(unplaced), depth))
            return []
        return unplaced

    rest = place(rows, 0)
    device = block_tables.device
    groups = []
    for members, shared in found:
        suffix_lens = [lens[row] - shared * block_size for row in members]
        width = -(-max(suffix_lens) // block_size)
        real = torch.arange(width * block_size, device=device)[None, :] < torch.tensor(suffix_lens, device=device)[:, None]
        groups.append(
            SharedPrefixGroup(
                token_index=torch.tensor([starts[row] for row in members], device=device),
                prefix_blocks=block_tables[members[0], :shared].long(),
                suffix_blocks=block_tables[members, shared : shared + width].flatten().long(),
                suffix_mask=real[:, None, None, :],
            )
        )
    return groups, sorted(rest)


def _length_buckets(rows: list[int], lens: list[int]) -> list[list[int]]:
    """Decode rows grouped by similar context length, so padding each group to its longest
    context wastes little of the K/V gather, which dominates CPU decode attention."""
    buckets: list[list[int]] = []
    longest = 0
    for row in sorted(rows, key=lambda i: lens[i], reverse=True):
        if not buckets or lens[row] < _BUCKET_FILL * longest or len(buckets[-1]) == _MAX_GROUP_ROWS:
            buckets.append([])
            longest = lens[row]
        buckets[-1].append(row)
    return buckets


def run_paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    scale: float,
    new_key: torch.Tensor | None = None,  # [T, num_kv_heads, head_dim]: this step's keys, already in the cache
    new_value: torch.Tensor | None = None,
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) (Gemma 2)
) -> torch.Tensor:
    """Prefill rows without a cached prefix attend to `new_key`/`new_value` when given (the same
    values the cache holds, without reading them back). Soft-capped scores take torch's math path,
    as transformers' eager attention does (the fused kernels have no soft-capping)."""
    attend = F.scaled_dot_product_attention if softcap is None else partial(_softcapped_attention, softcap=softcap)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if plan.decode_batch is not None:
        batch = plan.decode_batch
        paged_decode_attention(
            query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.token_index, scale, out,
            window=batch.window, softcap=softcap,
        )
    for decode in plan.decode_groups:
        batch = decode.token_index.shape[0]
        padded = (batch, decode.mask.shape[-1], num_kv_heads, head_dim)
        keys = read_blocks(k_cache, decode.blocks, query.dtype).view(padded).transpose(1, 2)
        values = read_blocks(v_cache, decode.blocks, query.dtype).view(padded).transpose(1, 2)
        # The query heads sharing a kv head lie along the query axis: GQA without repeating K/V.
        q = query[decode.token_index].view(batch, num_kv_heads, group, head_dim)
        attn = attend(q, keys, values, attn_mask=decode.mask, scale=scale)
        out[decode.token_index] = attn.reshape(batch, num_heads, head_dim)
    for shared in plan.shared_prefix_groups:
        out[shared.token_index] = _attend_shared_prefix(query, k_cache, v_cache, shared, scale)
    if plan.prefill_batch is not None:
        chunks = plan.prefill_batch
        paged_prefill_attention(
            query, k_cache, v_cache, chunks.block_tables, chunks.seq_lens, chunks.query_starts, chunks.query_ends,
            scale, out, window=chunks.window,
        )
    for prefill in plan.prefill_rows:
        if prefill.mask is None and new_key is not None and new_value is not None:
            keys, values = new_key[prefill.rows], new_value[prefill.rows]  # no prefix: what was just written
        else:
            length = prefill.seq_len - prefill.first_key
            keys = read_blocks(k_cache, prefill.blocks, query.dtype).flatten(0, 1)[:length]
            values = read_blocks(v_cache, prefill.blocks, query.dtype).flatten(0, 1)[:length]
        # 4-D inputs: torch's CPU flash kernel only takes batched inputs; 3-D falls back to the
        # much slower math path.
        q = query[prefill.rows].transpose(0, 1)[None]  # [1, H, q_len, D]
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        attn = attend(
            q, keys, values, attn_mask=prefill.mask, is_causal=prefill.mask is None, scale=scale, enable_gqa=group > 1
        )
        out[prefill.rows] = attn[0].transpose(0, 1)
    return out


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks' K or V [len(blocks), block_size, kv_heads, head_dim] in `dtype`: copied out in one pass
    (index_select; advanced indexing is markedly slower on CPU), and dequantized when the cache is int8 or fp8
    (conveyor_kernels/kv_quant.py), only the blocks read."""
    rows = cache.index_select(0, blocks)
    return kv_quant.dequantize(rows, dtype) if kv_quant.is_quantized(cache.dtype) else rows


def _softcapped_attention(
    q: torch.Tensor,  # [.., heads, q_len, D]
    keys: torch.Tensor,  # [.., kv_heads, kv_len, D]; query head h reads kv head h // (heads / kv_heads)
    values: torch.Tensor,
    attn_mask: torch.Tensor | None,  # bool, True where attended; broadcasts to [.., heads, q_len, kv_len]
    scale: float,
    softcap: float,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """scaled_dot_product_attention's contract with soft-capped scores, computed as transformers'
    eager attention does: scale, cap, mask, float32 softmax rounded back to q's dtype."""
    if keys.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // keys.shape[-3]
        keys, values = keys.repeat_interleave(repeat, dim=-3), values.repeat_interleave(repeat, dim=-3)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril_()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -torch.inf)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


def _attend_shared_prefix(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, shared: SharedPrefixGroup, scale: float
) -> torch.Tensor:
    """[g, num_heads, head_dim]: the group's rows over the prefix (all rows' queries against one
    copy of its K/V) and over their own suffixes, merged in float32."""
    rows = shared.token_index.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], query.shape[2]
    group = query.shape[1] // num_kv_heads
    q = query[shared.token_index].view(rows, num_kv_heads, group, head_dim)

    def gather(cache: torch.Tensor, blocks: torch.Tensor, batch: int) -> torch.Tensor:  # [batch, kv, len, D]
        return read_blocks(cache, blocks, query.dtype).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)

    # Every row's queries as one [kv, rows * group] matrix against the single copy of the prefix.
    prefix_q = q.transpose(0, 1).reshape(1, num_kv_heads, rows * group, head_dim)
    prefix_out, prefix_lse = _attention_with_lse(
        prefix_q, gather(k_cache, shared.prefix_blocks, 1), gather(v_cache, shared.prefix_blocks, 1), None, scale
    )
    prefix_out = prefix_out.view(num_kv_heads, rows, group, head_dim).transpose(0, 1)
    prefix_lse = prefix_lse.view(num_kv_heads, rows, group, 1).transpose(0, 1)
    suffix_bias = torch.zeros(shared.suffix_mask.shape, dtype=query.dtype).masked_fill_(~shared.suffix_mask, -torch.inf)
    suffix_out, suffix_lse = _attention_with_lse(
        q, gather(k_cache, shared.suffix_blocks, rows), gather(v_cache, shared.suffix_blocks, rows), suffix_bias, scale
    )
    suffix_lse = suffix_lse.unsqueeze(-1)
    lse = torch.logaddexp(prefix_lse, suffix_lse)
    merged = prefix_out.float() * (prefix_lse - lse).exp() + suffix_out.float() * (suffix_lse - lse).exp()
    return merged.reshape(rows, num_kv_heads * group, head_dim).to(query.dtype)


def _attention_with_lse(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax attention, the float32 log-sum-exp of its scores [.., L]), which merging partial
    results needs: torch's CPU flash-attention kernel, the one scaled_dot_product_attention runs on
    CPU, called directly for its log-sum-exp. `bias` is additive, in q's dtype."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, 0.0, False, attn_mask=bias, scale=scale)


def paged_attention_reference(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: Sequence[int],  # [B + 1]
    seq_lens: Sequence[int],  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    bidirectional_spans: Sequence[tuple[int, int, int]] = (),
) -> torch.Tensor:
    """Mixed prefill/decode attention in one call (plans and runs)."""
    plan = plan_paged_attention(
        query_start_loc, seq_lens, block_tables, k_cache.shape[1], window=window,
        bidirectional_spans=bidirectional_spans,
    )
    return run_paged_attention(query, k_cache, v_cache, plan, scale, softcap=softcap)
