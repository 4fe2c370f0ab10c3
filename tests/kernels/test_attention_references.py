"""The paged attention references are the oracle for the Triton kernels, so they are checked first:
against naive float64 attention over the dense K/V that were paged into the cache."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.decode_attention import decode_attention_reference
from conveyor_kernels.prefill_attention import prefill_attention_reference
from tests.kernels.kernel_testing import GQA_SHAPES, make_paged_kv, naive_attention



@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_prefill_reference_matches_naive_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(0)
    chunks = [(0, 1), (0, 17), (16, 16), (5, 11), (31, 1), (10, 0)]  # (cached prefix, new tokens)
    seq_lens = [prefix + q_len for prefix, q_len in chunks]
    paged = make_paged_kv(seq_lens, num_kv_heads, head_dim, torch.float32, "cpu", generator)
    starts = [0]
    for _, q_len in chunks:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5

    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    out = prefill_attention_reference(
        q, paged.k_cache, paged.v_cache, query_start_loc, paged.seq_lens, paged.block_tables, scale
    )

    for seq in range(len(chunks)):
        rows = slice(starts[seq], starts[seq + 1])
        expected = naive_attention(q[rows], paged.dense_k[seq], paged.dense_v[seq], scale)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_decode_reference_matches_naive_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(1)
    seq_lens = [1, 16, 17, 40]
    paged = make_paged_kv(seq_lens, num_kv_heads, head_dim, torch.float32, "cpu", generator)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5

    out = decode_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)

    for seq in range(len(seq_lens)):
        expected = naive_attention(q[seq : seq + 1], paged.dense_k[seq], paged.dense_v[seq], scale)
        torch.testing.assert_close(out[seq : seq + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_reference_gives_zeros_for_an_empty_context() -> None:
    generator = torch.Generator().manual_seed(2)
    paged = make_paged_kv([0, 5], 2, 64, torch.float32, "cpu", generator)
    q = torch.randn(2, 2, 64, generator=generator)
    out = decode_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125)
    assert torch.equal(out[0], torch.zeros(2, 64))
