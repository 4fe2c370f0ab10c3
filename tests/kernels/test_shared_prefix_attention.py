"""Decode rows that share cached blocks, attended as shared-prefix groups (the prefix's K/V read once
for the group, each row's suffix apart, merged by log-sum-exp), against naive float64 attention."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.cpu_kernels import load_cpu_kernels
from conveyor_kernels.paged_attention import plan_paged_attention, run_paged_attention
from tests.kernels.kernel_testing import GQA_SHAPES, naive_attention

BLOCK_SIZE = 16


def build_batch(num_kv_heads: int, head_dim: int, generator: torch.Generator):
    """Rows 0-4 share blocks 1-3 (48 tokens) and rows 5-6 share blocks 20-21; rows 0-6 and 8 decode
    one token, row 7 is a 5-token prefill chunk over blocks 1-2 (a prompt that found them cached)."""
    k_cache = torch.randn(40, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(40, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    tables = [
        [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 3, 7, 8], [1, 2, 3, 9, 10],
        [20, 21, 22], [20, 21, 23],
        [1, 2, 24],
        [30, 31],
    ]
    seq_lens = [49, 60, 64, 65, 80, 35, 48, 37, 20]
    query_lens = [1, 1, 1, 1, 1, 1, 1, 5, 1]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return k_cache, v_cache, block_tables, tables, seq_lens, query_lens, starts


@pytest.mark.parametrize("use_decode_kernel", [False, True], ids=["torch", "cpu_kernel"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_shared_prefix_groups_match_naive_attention(num_heads, num_kv_heads, head_dim, use_decode_kernel):
    if use_decode_kernel and load_cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    generator = torch.Generator().manual_seed(4)
    k_cache, v_cache, block_tables, tables, seq_lens, query_lens, starts = build_batch(num_kv_heads, head_dim, generator)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5

    plan = plan_paged_attention(
        starts, seq_lens, block_tables, BLOCK_SIZE, use_decode_kernel=use_decode_kernel, shared_prefix_min_saved_tokens=16
    )
    grouped = sorted(sorted(starts[i] for i in group) for group in ([0, 1, 2, 3, 4], [5, 6]))
    assert sorted(sorted(g.token_index.tolist()) for g in plan.shared_prefix_groups) == grouped
    out = run_paged_attention(q, k_cache, v_cache, plan, scale)

    for seq, table in enumerate(tables):
        dense_k = k_cache[table].flatten(0, 1)[: seq_lens[seq]]
        dense_v = v_cache[table].flatten(0, 1)[: seq_lens[seq]]
        rows = slice(starts[seq], starts[seq + 1])
        expected = naive_attention(q[rows], dense_k, dense_v, scale)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)


def test_groups_form_only_where_they_save_enough_reads():
    generator = torch.Generator().manual_seed(5)
    _, _, block_tables, _, seq_lens, _, starts = build_batch(2, 64, generator)
    # Rows 0-4 save 4 x 48 = 192 tokens' reads; rows 5-6 save 1 x 32.
    plan = plan_paged_attention(starts, seq_lens, block_tables, BLOCK_SIZE, shared_prefix_min_saved_tokens=100)
    assert [sorted(g.token_index.tolist()) for g in plan.shared_prefix_groups] == [[0, 1, 2, 3, 4]]
    assert plan_paged_attention(starts, seq_lens, block_tables, BLOCK_SIZE).shared_prefix_groups == ()


def test_rows_join_the_deepest_prefix_they_share():
    """Every prompt starts with the same template block (1); rows 0-2 then share a document (blocks
    10-12), rows 3-5 another (20-22): two groups over four blocks each, not one over the template."""
    tables = [[1, 10, 11, 12, 30 + row] for row in range(3)] + [[1, 20, 21, 22, 40 + row] for row in range(3)]
    block_tables = torch.tensor(tables, dtype=torch.int32)
    seq_lens = [4 * BLOCK_SIZE + 3] * 6
    plan = plan_paged_attention(list(range(7)), seq_lens, block_tables, BLOCK_SIZE, shared_prefix_min_saved_tokens=1)
    groups = sorted((g.token_index.tolist(), g.prefix_blocks.tolist()) for g in plan.shared_prefix_groups)
    assert groups == [([0, 1, 2], [1, 10, 11, 12]), ([3, 4, 5], [1, 20, 21, 22])]
