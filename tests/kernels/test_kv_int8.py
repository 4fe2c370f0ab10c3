"""The int8 KV cache's rows (kernels/kv_int8.py) and the C++ decode attention reading them: the kernel against
`paged_attention_reference` over the same int8 cache (which dequantizes the blocks it gathers), at odd shapes
(block size 5, head_dim 72, GQA 3, ragged lengths, a window, soft-capping)."""

from __future__ import annotations

import pytest
import torch

from kernels import kv_int8
from kernels.cpu_kernels import load_cpu_kernels, paged_decode_attention
from kernels.paged_attention import paged_attention_reference


def test_rows_round_trip_within_half_a_step():
    rows = torch.randn(7, 3, 72, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    packed = kv_int8.quantize(rows)
    assert packed.dtype == torch.int8 and packed.shape == (7, 3, kv_int8.row_width(72))
    step = rows.abs().amax(dim=-1, keepdim=True) / 127
    assert ((kv_int8.dequantize(packed, torch.float32) - rows).abs() <= step / 2 + 1e-7 * step).all()
    assert (kv_int8.dequantize(kv_int8.quantize(torch.zeros(2, 72)), torch.float32) == 0).all()


def _int8_paged_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, generator):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Rows of very different magnitudes, so a wrong row's scale shows.
    magnitude = torch.rand(num_blocks, block_size, num_kv_heads, 1, generator=generator) * 4 + 0.05
    k = kv_int8.quantize(torch.randn(shape, generator=generator) * magnitude)
    v = kv_int8.quantize(torch.randn(shape, generator=generator) * magnitude)
    return k, v


@pytest.mark.skipif("load_cpu_kernels() is None", reason="the C++ CPU kernels could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 72), (4, 4, 64), (8, 2, 128)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (11, 30.0)])
def test_int8_decode_attention_matches_the_reference(dtype, num_heads, num_kv_heads, head_dim, window, softcap):
    generator = torch.Generator().manual_seed(num_heads + head_dim)
    block_size = 5
    seq_lens = [1, 4, 5, 6, 23, 61]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks + 2
    k_cache, v_cache = _int8_paged_cache(num_blocks, block_size, num_kv_heads, head_dim, generator)
    block_tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * max_blocks]
    block_tables = block_tables.view(len(seq_lens), max_blocks).int()
    fused = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    query = fused[:, :num_heads]  # a strided slice of a fused projection, as the model hands it over
    scale = head_dim**-0.5

    # The reference in float32 from the same int8 cache: the kernel dequantizes and accumulates in float32 too.
    expected = paged_attention_reference(
        query.float(), k_cache, v_cache, list(range(len(seq_lens) + 1)), seq_lens, block_tables, scale,
        window=window, softcap=softcap,
    )
    out = torch.full((len(seq_lens), num_heads, head_dim), float("nan"), dtype=dtype)
    paged_decode_attention(
        query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
        torch.arange(len(seq_lens)), scale, out, window=window, softcap=softcap,
    )
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
