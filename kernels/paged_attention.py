"""Paged attention in plain torch: the CPU path of the engine and the oracle for the Triton kernels.

Cache layout, per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V. A batch is
flat ("varlen"): sequence i owns query rows `[query_start_loc[i], query_start_loc[i+1])`, and its
`seq_lens[i]` counts every token in its context including the new ones, which are already written
to the cache. New token j of a sequence with q_len new tokens sits at position seq_len - q_len + j
and attends to cache positions 0..that position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, num_kv_heads, head_dim] of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def paged_attention_reference(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: Sequence[int],  # [B + 1]
    seq_lens: Sequence[int],  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
) -> torch.Tensor:
    """Mixed prefill/decode attention. Decode rows (one new token) run as one batched call; rows with
    several new tokens (prefill chunks) run one sequence at a time, since their shapes differ."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = list(query_start_loc)
    lens = list(seq_lens)
    query_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]

    decode_rows = [i for i, q_len in enumerate(query_lens) if q_len == 1]
    if decode_rows:
        _decode(query, k_cache, v_cache, starts, lens, block_tables, decode_rows, group, scale, out)

    for i, q_len in enumerate(query_lens):
        if q_len <= 1:
            continue
        seq_len = lens[i]
        rows = slice(starts[i], starts[i + 1])
        keys = _gather_context(k_cache, block_tables[i], seq_len)
        values = _gather_context(v_cache, block_tables[i], seq_len)
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        # 4-D inputs: torch's CPU flash kernel only takes batched inputs; 3-D falls back to the
        # much slower math path.
        q = query[rows].transpose(0, 1)[None]  # [1, H, q_len, D]
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        if q_len == seq_len:
            attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
        else:
            query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= query_pos[:, None]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        out[rows] = attn[0].transpose(0, 1)
    return out


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: list[int],
    lens: list[int],
    block_tables: torch.Tensor,
    decode_rows: list[int],
    group: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """All single-token rows at once: gather each row's blocks into a padded [B, L] context and mask
    the tail. The query heads sharing a kv head are laid along the query axis, so GQA needs no
    K/V repetition."""
    device = query.device
    block_size = k_cache.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    row_index = torch.tensor(decode_rows, device=device)
    token_index = torch.tensor([starts[i] for i in decode_rows], device=device)
    context_lens = torch.tensor([lens[i] for i in decode_rows], device=device)
    max_blocks = -(-max(lens[i] for i in decode_rows) // block_size)
    blocks = block_tables[row_index, :max_blocks].flatten()
    batch = len(decode_rows)
    padded = (batch, max_blocks * block_size, num_kv_heads, head_dim)
    # index_select copies whole blocks in one pass; advanced indexing is markedly slower on CPU.
    keys = k_cache.index_select(0, blocks).view(padded).transpose(1, 2)
    values = v_cache.index_select(0, blocks).view(padded).transpose(1, 2)
    q = query[token_index].view(batch, num_kv_heads, group, head_dim)
    mask = torch.arange(max_blocks * block_size, device=device)[None, :] < context_lens[:, None]
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    out[token_index] = attn.reshape(batch, num_kv_heads * group, head_dim)
