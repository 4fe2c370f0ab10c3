"""Triton paged prefill / extend attention against its reference."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.decode_attention import decode_attention_reference
from conveyor_kernels.prefill_attention import prefill_attention, prefill_attention_reference
from tests.kernels.kernel_testing import DTYPES, GQA_SHAPES, make_paged_kv, poisoned, tolerance

# (cached prefix, new tokens) per sequence: fresh prompts and later chunks ending just before, on
# and just past 16-token block boundaries, single-token (decode) rows, and an idle sequence.
CHUNKS = [(0, 1), (0, 16), (0, 17), (5, 11), (16, 16), (15, 2), (31, 1), (0, 33), (40, 7), (10, 0)]


def _run(
    device: str,
    dtype: torch.dtype,
    chunks: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    seed: int = 0,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [prefix + q_len for prefix, q_len in chunks]
    paged = make_paged_kv(seq_lens, num_kv_heads, head_dim, dtype, device, generator, block_size)
    starts = [0]
    for _, q_len in chunks:
        starts.append(starts[-1] + q_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    out = poisoned(tuple(q.shape), dtype, device)
    max_query_len = max(q_len for _, q_len in chunks)

    returned = prefill_attention(
        q, paged.k_cache, paged.v_cache, query_start_loc, paged.seq_lens, paged.block_tables, scale, max_query_len, out
    )

    assert returned is out
    expected = prefill_attention_reference(
        q, paged.k_cache, paged.v_cache, query_start_loc, paged.seq_lens, paged.block_tables, scale
    )
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matches_reference(
    device: str, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    _run(device, dtype, CHUNKS, num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("block_size", [8, 32])
def test_prefill_with_other_block_sizes(device: str, block_size: int) -> None:
    _run(device, torch.float32, [(0, 9), (7, 9), (24, 8), (31, 2)], 8, 2, 64, block_size=block_size)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 1)])
def test_prefill_of_decode_rows_matches_decode_reference(device: str, num_heads: int, num_kv_heads: int) -> None:
    """A batch of single-token rows takes the shortest query tiles and must agree with decode."""
    generator = torch.Generator().manual_seed(5)
    seq_lens = [1, 16, 17, 40]
    paged = make_paged_kv(seq_lens, num_kv_heads, 64, torch.bfloat16, device, generator)
    q = torch.randn(len(seq_lens), num_heads, 64, generator=generator).to(device, torch.bfloat16)
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
    out = prefill_attention(
        q, paged.k_cache, paged.v_cache, query_start_loc, paged.seq_lens, paged.block_tables, 0.125, 1,
        poisoned(tuple(q.shape), torch.bfloat16, device),
    )
    expected = decode_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125)
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))


def test_prefill_reads_strided_query_and_writes_strided_output(device: str) -> None:
    """Two chunks, (prefix 0, 5 new) and (prefix 12, 6 new); q sliced out of a fused qkv
    projection, out a slice of a wider buffer."""
    generator = torch.Generator().manual_seed(6)
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    paged = make_paged_kv([5, 18], num_kv_heads, head_dim, torch.bfloat16, device, generator)
    qkv = torch.randn(11, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    q = qkv[:, :num_heads]
    wide = poisoned((11, num_heads + 1, head_dim), torch.bfloat16, device)
    out = wide[:, 1:]
    query_start_loc = torch.tensor([0, 5, 11], dtype=torch.int32, device=device)

    prefill_attention(
        q, paged.k_cache, paged.v_cache, query_start_loc, paged.seq_lens, paged.block_tables, 0.125, 6, out
    )

    expected = prefill_attention_reference(
        q, paged.k_cache, paged.v_cache, query_start_loc, paged.seq_lens, paged.block_tables, 0.125
    )
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))
    assert wide[:, 0].isnan().all()
