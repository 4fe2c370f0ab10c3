"""Triton paged decode attention against its reference."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.decode_attention import decode_attention, decode_attention_reference
from tests.kernels.kernel_testing import DTYPES, GQA_SHAPES, make_paged_kv, poisoned, tolerance

# Contexts ending just before, exactly on and just past block boundaries (block_size 16), and one
# spanning several key tiles per split.
SEQ_LENS = [1, 15, 16, 17, 33, 47]


def _run(
    device: str,
    dtype: torch.dtype,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_splits: int | None,
    block_size: int = 16,
    seed: int = 0,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    paged = make_paged_kv(seq_lens, num_kv_heads, head_dim, dtype, device, generator, block_size)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    out = poisoned(tuple(q.shape), dtype, device)

    returned = decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale, out=out, num_splits=num_splits
    )

    assert returned is out
    expected = decode_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(
    device: str, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int, num_splits: int | None
) -> None:
    _run(device, dtype, SEQ_LENS, num_heads, num_kv_heads, head_dim, num_splits)


def test_decode_with_default_splits(device: str) -> None:
    """The launcher picks the split count (on a GPU from its SM count: several splits here)."""
    _run(device, torch.bfloat16, SEQ_LENS, 8, 2, 128, num_splits=None)


@pytest.mark.parametrize("block_size", [8, 32])
def test_decode_with_other_block_sizes(device: str, block_size: int) -> None:
    """Key tiles of 16 span several 8-token blocks, or half of a 32-token one."""
    _run(device, torch.float32, [7, 8, 9, 31, 32, 33, 50], 8, 2, 64, num_splits=2, block_size=block_size)


def test_decode_with_more_splits_than_tiles(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Most partitions are empty; their partial results must still be written (as -inf / 0), so
    the workspace starts out as NaN here."""
    real_empty = torch.empty

    def nan_filled_empty(*args: object, **kwargs: object) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", nan_filled_empty)
    _run(device, torch.float32, [1, 16, 17, 40], 8, 2, 64, num_splits=8)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_gives_zeros_for_an_empty_context(device: str, num_splits: int) -> None:
    """seq_len 0 (a padding entry of a fixed-size batch) yields zeros rather than NaN."""
    generator = torch.Generator().manual_seed(3)
    paged = make_paged_kv([0, 20], 2, 64, torch.float32, device, generator)
    q = torch.randn(2, 4, 64, generator=generator).to(device)
    out = decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125, num_splits=num_splits
    )
    expected = decode_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_decode_reads_strided_query_and_writes_strided_output(device: str) -> None:
    """q sliced out of a fused qkv projection, out a slice of a wider buffer."""
    generator = torch.Generator().manual_seed(4)
    seq_lens = [5, 17, 33]
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    paged = make_paged_kv(seq_lens, num_kv_heads, head_dim, torch.bfloat16, device, generator)
    qkv = torch.randn(3, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    q = qkv[:, :num_heads]
    wide = poisoned((3, num_heads + 1, head_dim), torch.bfloat16, device)
    out = wide[:, 1:]

    decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125, out=out, num_splits=2)

    expected = decode_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125)
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))
    assert wide[:, 0].isnan().all()
