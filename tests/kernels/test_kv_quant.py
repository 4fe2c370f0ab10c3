"""The int8 KV cache's rows (kernels/kv_quant.py) and the C++ decode attention reading them: the kernel against
`paged_attention_reference` over the same int8 cache (which dequantizes the blocks it gathers), at odd shapes
(block size 5, head_dim 72, GQA 3, ragged lengths, a window, soft-capping)."""

from __future__ import annotations

import pytest
import torch

from kernels import kv_quant
from kernels.cpu_kernels import load_cpu_kernels, paged_decode_attention
from kernels.paged_attention import paged_attention_reference
from kernels.triton_utils import interpreter_enabled


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_rows_round_trip_within_half_a_step(dtype):
    rows = torch.randn(7, 3, 72, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    packed = kv_quant.quantize(rows, dtype)
    assert packed.dtype == dtype and packed.shape == (7, 3, kv_quant.row_width(72))
    amax = rows.abs().amax(dim=-1, keepdim=True)
    error = (kv_quant.dequantize(packed, torch.float32) - rows).abs()
    if dtype == torch.int8:  # half a step of amax / 127
        assert (error <= amax / 127 / 2 * (1 + 1e-6)).all()
    else:  # e4m3 keeps 3 mantissa bits: half a unit in the last place, relative (normal values), 2^-10 x amax / 448 below
        assert (error <= torch.maximum(rows.abs() / 16, amax / 448 * 2**-10) * (1 + 1e-6)).all()
    assert (kv_quant.dequantize(kv_quant.quantize(torch.zeros(2, 72), dtype), torch.float32) == 0).all()


def _int8_paged_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, generator):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Rows of very different magnitudes, so a wrong row's scale shows.
    magnitude = torch.rand(num_blocks, block_size, num_kv_heads, 1, generator=generator) * 4 + 0.05
    k = kv_quant.quantize(torch.randn(shape, generator=generator) * magnitude, torch.int8)
    v = kv_quant.quantize(torch.randn(shape, generator=generator) * magnitude, torch.int8)
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


def _fp8_paged(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, device: str, generator):
    """An fp8 cache holding random rows of varied magnitudes, scattered block tables (padding entries: block 0)."""
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks + 2
    k_cache, v_cache = (
        kv_quant.quantize(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
                          * (torch.rand(num_blocks, block_size, num_kv_heads, 1, generator=generator) + 0.2),
                          torch.float8_e4m3fn).to(device)
        for _ in range(2)
    )
    tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * max_blocks].view(len(seq_lens), -1)
    return k_cache, v_cache, tables.int().to(device)


def test_triton_write_quantizes_to_fp8_as_the_reference(device: str) -> None:
    from kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference

    generator = torch.Generator().manual_seed(2)
    num_kv_heads, head_dim, block_size = 3, 40, 5
    qkv = torch.randn(9, 4 + 2 * num_kv_heads, head_dim, generator=generator) * torch.rand(9, 1, 1, generator=generator) * 9
    qkv = qkv.to(device)
    key, value = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]  # strided, as the model hands them over
    slots = torch.randperm(4 * block_size, generator=generator)[:9].to(device)
    slots[::4] = -1
    caches = [torch.zeros(4, block_size, num_kv_heads, kv_quant.row_width(head_dim), dtype=torch.float8_e4m3fn,
                          device=device) for _ in range(4)]
    write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_cache_reference(key, value, caches[2], caches[3], slots)
    for got, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        # Scales equal; values within one e4m3 step (a GPU's division may round its last bit differently; codes of
        # one sign are ordered by magnitude). The interpreter's float32 -> fp8 conversion drops the carry when
        # rounding up crosses a power of two (31.9 -> 16 instead of 32): there, and only under it, half is accepted.
        torch.testing.assert_close(got[..., head_dim:].contiguous().view(torch.float32),
                                   expected[..., head_dim:].contiguous().view(torch.float32), rtol=1e-6, atol=0)
        got_codes, expected_codes = (c[..., :head_dim].view(torch.uint8).int() for c in (got, expected))
        close = (got_codes - expected_codes).abs() <= 1
        if interpreter_enabled():
            got_values, expected_values = got[..., :head_dim].float(), expected[..., :head_dim].float()
            mantissa, _ = torch.frexp(expected_values)
            close |= (got_values * 2 == expected_values) & (mantissa.abs() == 0.5)
        assert close.all()


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4)])
def test_triton_attention_reads_an_fp8_cache_as_the_reference(device: str, num_heads: int, num_kv_heads: int) -> None:
    from kernels.decode_attention import decode_attention, decode_attention_reference
    from kernels.prefill_attention import prefill_attention, prefill_attention_reference

    generator = torch.Generator().manual_seed(num_heads)
    head_dim, block_size, dtype = 64, 16, torch.bfloat16
    seq_lens = [1, 17, 40]
    k_cache, v_cache, tables = _fp8_paged(seq_lens, num_kv_heads, head_dim, block_size, device, generator)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    tol = {"atol": 2e-2, "rtol": 2e-2}

    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(device, dtype)
    out = decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=2)
    torch.testing.assert_close(out, decode_attention_reference(q, k_cache, v_cache, tables, lens, scale), **tol)

    query_lens = [1, 9, 40]  # a decode row, a chunk after a cached prefix, a whole prompt
    starts = torch.tensor([0, 1, 10, 50], dtype=torch.int32, device=device)
    q = torch.randn(50, num_heads, head_dim, generator=generator).to(device, dtype)
    out = prefill_attention(q, k_cache, v_cache, starts, lens, tables, scale, max(query_lens), window=13)
    expected = prefill_attention_reference(q, k_cache, v_cache, starts, lens, tables, scale, window=13)
    torch.testing.assert_close(out, expected, **tol)
