"""The int8 KV cache's rows (conveyor_kernels/kv_quant.py) and the C++ decode attention reading them (and float32
caches, which its vector kernels read too): every path against `paged_attention_reference` over the same cache (which
dequantizes the int8 blocks it gathers), at odd shapes (block size 5, head_dim 72, GQA 3, ragged lengths, a window,
soft-capping)."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels import kv_quant
from conveyor_kernels.cpu_kernels import (
    load_cpu_kernels,
    load_vector_decode_kernels,
    paged_decode_attention,
    vector_decode_paths,
)
from conveyor_kernels.paged_attention import paged_attention_reference
from conveyor_kernels.triton_utils import interpreter_enabled


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


def _paged_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, generator,
                 cache_dtype: torch.dtype = torch.int8):
    """Rows of very different magnitudes, so a wrong row's scale shows: int8 rows, or with `cache_dtype` float32 the
    rows themselves."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    magnitude = torch.rand(num_blocks, block_size, num_kv_heads, 1, generator=generator) * 4 + 0.05
    k, v = (torch.randn(shape, generator=generator) * magnitude for _ in range(2))
    if cache_dtype == torch.float32:
        return k, v
    return kv_quant.quantize(k, torch.int8), kv_quant.quantize(v, torch.int8)


@pytest.mark.skipif("load_cpu_kernels() is None", reason="the C++ CPU kernels could not be built here")
@pytest.mark.parametrize(
    ("cache_dtype", "dtype"), [(torch.int8, torch.float32), (torch.int8, torch.bfloat16), (torch.float32, torch.float32)]
)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 72, 5), (4, 4, 64, 5), (8, 2, 128, 5), (9, 3, 64, 16), (12, 3, 128, 16)],
)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (11, 30.0)])
def test_decode_attention_matches_the_reference(cache_dtype, dtype, num_heads, num_kv_heads, head_dim, block_size, window,
                                                softcap):
    """Every path this CPU runs (AVX-512, AVX2, portable; head_dim 72 has only the portable one), forced by name, on
    contexts shorter and longer than the vector kernels' spans (16-64 positions) and not multiples of them or of the
    block size."""
    generator = torch.Generator().manual_seed(num_heads + head_dim + block_size)
    seq_lens = [1, 4, 5, 6, 23, 61, 64, 97, 150]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks + 2
    k_cache, v_cache = _paged_cache(num_blocks, block_size, num_kv_heads, head_dim, generator, cache_dtype)
    block_tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * max_blocks]
    block_tables = block_tables.view(len(seq_lens), max_blocks).int()
    if window is not None:  # blocks wholly before the window: freed, as the block manager leaves them
        for row, length in enumerate(seq_lens):
            block_tables[row, : max(0, length - window) // block_size] = -1
    fused = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    query = fused[:, :num_heads]  # a strided slice of a fused projection, as the model hands it over
    scale = head_dim**-0.5

    # The reference in float32 from the same cache: the kernels dequantize and accumulate in float32 too.
    expected = paged_attention_reference(
        query.float(), k_cache, v_cache, list(range(len(seq_lens) + 1)), seq_lens, block_tables, scale,
        window=window, softcap=softcap,
    )
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    paths = vector_decode_paths(head_dim, dtype, cache_dtype)
    assert paths[0] == "portable" and (head_dim == 72 or paths[-1] == load_vector_decode_kernels().best_isa())
    for path in paths:
        # Rows of `out` that are no decode row's stay untouched.
        out = torch.full((len(seq_lens) + 1, num_heads, head_dim), float("nan"), dtype=dtype)
        paged_decode_attention(
            query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
            torch.arange(len(seq_lens)), scale, out, window=window, softcap=softcap, path=path,
        )
        torch.testing.assert_close(out[:-1].float(), expected, atol=tolerance, rtol=tolerance, msg=path)
        assert out[-1].isnan().all(), path


@pytest.mark.skipif("load_cpu_kernels() is None", reason="the C++ CPU kernels could not be built here")
def test_int8_decode_attention_of_many_sequences_in_any_order():
    """48 sequences of random lengths whose decode rows sit in `out` in another order, each path's threads handing
    sequences out among themselves (and prefetching the next one's first rows)."""
    generator = torch.Generator().manual_seed(48)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    seq_lens = torch.randint(1, 200, (48,), generator=generator).tolist()
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks
    k_cache, v_cache = _paged_cache(num_blocks, block_size, num_kv_heads, head_dim, generator)
    block_tables = torch.randperm(num_blocks, generator=generator).view(len(seq_lens), max_blocks).int()
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).bfloat16()
    rows = torch.randperm(len(seq_lens), generator=generator)  # sequence i's query is row rows[i]
    expected = paged_attention_reference(
        query[rows].float(), k_cache, v_cache, list(range(len(seq_lens) + 1)), seq_lens, block_tables, head_dim**-0.5
    )
    for path in vector_decode_paths(head_dim, torch.bfloat16, torch.int8):
        out = torch.full_like(query, float("nan"))
        paged_decode_attention(
            query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), rows, head_dim**-0.5,
            out, path=path,
        )
        torch.testing.assert_close(out[rows].float(), expected, atol=2e-2, rtol=2e-2, msg=path)


@pytest.mark.skipif("load_cpu_kernels() is None", reason="the C++ CPU kernels could not be built here")
def test_a_path_the_call_cannot_take_is_refused():
    k_cache, v_cache = _paged_cache(2, 4, 1, 72, torch.Generator().manual_seed(0))
    query, out = torch.randn(1, 2, 72), torch.empty(1, 2, 72)
    args = (torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5], dtype=torch.int32), torch.arange(1), 0.1, out)
    with pytest.raises(ValueError, match="no avx2 decode attention here for head_dim 72"):
        paged_decode_attention(query, k_cache, v_cache, *args, path="avx2")
    cache = torch.randn(2, 4, 1, 64).half()  # fp16: the portable kernel only
    with pytest.raises(ValueError, match="no avx2 decode attention here for head_dim 64, torch.float16 queries"):
        paged_decode_attention(cache[0, :1], cache, cache, *args[:4], torch.empty(1, 1, 64).half(), path="avx2")


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
    from conveyor_kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference

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
    from conveyor_kernels.decode_attention import decode_attention, decode_attention_reference
    from conveyor_kernels.prefill_attention import prefill_attention, prefill_attention_reference

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
