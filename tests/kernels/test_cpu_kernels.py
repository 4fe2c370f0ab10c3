"""The C++ CPU kernels against their torch oracles, on random (never zero) inputs with ragged
lengths, block-boundary lengths, GQA ratios 1/3/4/8 and both dtypes; outputs poisoned first. The bf16 decode
attention also against torch's own bf16 attention: its error from the exact result is about torch's.
The AMX encoder attention (bf16 only) against exact attention, as close as torch's flash kernel;
the bf16 LayerNorm against torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor_kernels.cpu_kernels import (
    encoder_attention,
    encoder_kernels_available,
    layer_norm,
    load_cpu_kernels,
    paged_decode_attention,
    rms_norm,
    rotary_in_place,
    silu_and_mul,
    write_kv_cache,
)
from conveyor_kernels.kv_cache_write import write_kv_cache_reference
from conveyor_kernels.paged_attention import paged_attention_reference
from tests.kernels.kernel_testing import make_paged_kv, naive_attention

# A string condition: evaluated when the test runs, so collecting builds no C++ kernels.
pytestmark = pytest.mark.skipif("load_cpu_kernels() is None", reason="the C++ CPU kernels could not be built here")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 2, 64)]
)
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_attention_matches_the_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    generator = torch.Generator().manual_seed(num_heads * block_size)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size, 77, 130]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    # Scattered, non-overlapping block tables.
    block_tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * max_blocks]
    block_tables = block_tables.view(len(seq_lens), max_blocks).int()
    # One query row per sequence, laid out as a strided slice of a wider fused projection.
    fused = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    query = fused[:, :num_heads]
    scale = head_dim**-0.5

    expected = paged_attention_reference(
        query, k_cache, v_cache, list(range(len(seq_lens) + 1)), seq_lens, block_tables, scale
    )
    out = torch.full((len(seq_lens), num_heads, head_dim), float("nan"), dtype=dtype)
    paged_decode_attention(
        query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
        torch.arange(len(seq_lens)), scale, out,
    )
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 50])
def test_bf16_decode_attention_is_as_close_as_torch_sdpa(num_heads, num_kv_heads, head_dim, window):
    """The bf16 kernel rounds the probabilities to bf16 for p.v, as torch's bf16 attention does: measured against
    the float64 oracle on the same bf16 inputs, its error is close to torch's bf16 scaled_dot_product_attention's
    (both mostly the output's own rounding): on these cases its largest error is within 1.09x torch's, its mean
    error 1.14-1.2x. The bounds leave a little room over that.
    Contexts of odd lengths, shorter and longer than the kernel's 64-position spans and not multiples of them;
    with a window, the blocks wholly before it are -1 in the tables, as the block manager leaves freed blocks."""
    generator = torch.Generator().manual_seed(num_heads * head_dim + (window or 0))
    seq_lens = [1, 2, 15, 63, 64, 65, 127, 129, 200, 333]
    paged = make_paged_kv(seq_lens, num_kv_heads, head_dim, torch.bfloat16, "cpu", generator, block_size=16)
    if window is not None:
        for row, length in enumerate(seq_lens):
            paged.block_tables[row, : max(0, length - window) // 16] = -1
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).bfloat16()
    scale = 2 * head_dim**-0.5  # peaked softmaxes: the probabilities' rounding shows

    out = torch.full_like(query, float("nan"))
    paged_decode_attention(
        query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, torch.arange(len(seq_lens)), scale,
        out, window=window,
    )

    group = num_heads // num_kv_heads
    ours, torchs = [], []
    for row, length in enumerate(seq_lens):
        exact = naive_attention(query[row : row + 1], paged.dense_k[row], paged.dense_v[row], scale, window)[0]
        first = 0 if window is None else max(0, length - window)
        keys, values = (
            dense[row][first:].repeat_interleave(group, 1).transpose(0, 1) for dense in (paged.dense_k, paged.dense_v)
        )
        sdpa = F.scaled_dot_product_attention(query[row][:, None], keys, values, scale=scale)[:, 0]
        ours.append((out[row].double() - exact).abs())
        torchs.append((sdpa.double() - exact).abs())
    ours, torchs = torch.stack(ours), torch.stack(torchs)
    assert ours.max() <= 1.25 * torchs.max()
    assert ours.mean() <= 1.3 * torchs.mean()


def test_paged_decode_attention_writes_only_its_rows():
    k_cache = torch.randn(8, 4, 2, 64)
    v_cache = torch.randn(8, 4, 2, 64)
    query = torch.randn(5, 2, 64)
    out = torch.full_like(query, float("nan"))
    token_index = torch.tensor([1, 3])
    paged_decode_attention(
        query, k_cache, v_cache, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([5, 8], dtype=torch.int32), token_index, 0.125, out,
    )
    assert not out[token_index].isnan().any()
    assert out[[0, 2, 4]].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_expression(dtype, rows, with_residual):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator).to(dtype)
    residual = torch.randn(rows, 576, generator=generator).to(dtype) if with_residual else None
    weight = torch.randn(576, generator=generator).to(dtype)
    summed = x + residual if with_residual else x
    # Hugging Face Llama's RMSNorm: float32 statistics, rounded before the weight multiplies it.
    as_float = summed.float()
    expected = weight * (as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    given_residual = residual.clone() if with_residual else None
    out = rms_norm(x, given_residual, weight, 1e-5)

    tolerance = 1e-5 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    if with_residual:
        assert torch.equal(given_residual, summed), "the residual must be updated to x + residual"
    torch.testing.assert_close(out, F.rms_norm(summed, (576,), weight, 1e-5), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128)])
def test_rotary_in_place_is_the_torch_expression_bit_for_bit(dtype, rows, num_heads, num_kv_heads, head_dim):
    """q and k rotated where they lie in a fused projection (strided rows), v untouched; cos and sin rounded to the
    dtype first, as the model's torch path does."""
    generator = torch.Generator().manual_seed(rows + head_dim)
    qkv = (4 * torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)).to(dtype)
    angles = torch.rand(rows, 1, head_dim // 2, generator=generator) * 1000
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(rows, num_heads + num_kv_heads, head_dim)
    x1, x2 = qk.chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    value_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()

    rotary_in_place(qk, cos, sin)

    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], value_before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (7, 37), (300, 1536)])
def test_silu_and_mul_rounds_as_the_torch_ops(dtype, rows, width):
    """exp may differ from torch's in its last float bits: the activation one step of the dtype off, rarely,
    which the product with `up` carries into at most two steps of its own rounding."""
    generator = torch.Generator().manual_seed(rows * width)
    gate_up = (4 * torch.randn(rows, 2 * width, generator=generator)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = silu_and_mul(gate_up)
    assert out.shape == (rows, width) and out.dtype == dtype
    step = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=2 * step)
    assert (out != expected).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_the_reference(dtype):
    """Strided K/V rows (slices of a fused projection) into scattered slots; slot -1 drops its token."""
    generator = torch.Generator().manual_seed(3)
    num_kv_heads, head_dim, block_size = 3, 64, 16
    fused = torch.randn(40, (3 + 2) * num_kv_heads * head_dim, generator=generator).to(dtype)
    key = fused[:, 3 * num_kv_heads * head_dim : 4 * num_kv_heads * head_dim].view(40, num_kv_heads, head_dim)
    value = fused[:, 4 * num_kv_heads * head_dim :].view(40, num_kv_heads, head_dim)
    slots = torch.randperm(10 * block_size, generator=generator)[:40]
    slots[[5, 17]] = -1
    caches = [torch.randn(10, block_size, num_kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    write_kv_cache_reference(key, value, *expected, slots)
    write_kv_cache(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.skipif("not encoder_kernels_available()", reason="needs a CPU with AMX")
@pytest.mark.parametrize("num_heads", [1, 12])
def test_encoder_attention_is_as_close_to_exact_as_torch_flash_attention(num_heads):
    """Packed sequences across every tile boundary (16 keys, 32 queries), then rows of no sequence."""
    generator = torch.Generator().manual_seed(num_heads)
    seq_lens = [1, 5, 16, 17, 31, 32, 33, 100, 256]
    starts = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    qkv = (2 * torch.randn(starts[-1] + 3, 3 * num_heads * 32, generator=generator)).to(torch.bfloat16)
    out = encoder_attention(qkv, torch.tensor(starts), num_heads, 32**-0.5)
    assert out.shape == (starts[-1] + 3, num_heads * 32) and out.dtype == torch.bfloat16
    for start, stop in zip(starts, starts[1:]):
        q, k, v = qkv[start:stop].view(1, stop - start, 3, num_heads, 32).permute(2, 0, 3, 1, 4)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        flash_error = (F.scaled_dot_product_attention(q, k, v).double() - exact).abs().max().item()
        ours = out[start:stop].view(1, stop - start, num_heads, 32).transpose(1, 2).double()
        assert (ours - exact).abs().max().item() <= max(flash_error, 2**-8), (start, stop)
    assert (out[starts[-1] :] == 0).all()


@pytest.mark.skipif("not encoder_kernels_available()", reason="needs a CPU with AMX")
@pytest.mark.parametrize(("rows", "size"), [(1, 16), (7, 384), (300, 1024)])
def test_layer_norm_matches_torch_in_bfloat16(rows, size):
    generator = torch.Generator().manual_seed(rows)
    x, weight, bias = (torch.randn(n, generator=generator) for n in (rows * size, size, size))
    x, weight, bias = (3 * x + 1).view(rows, size).bfloat16(), weight.bfloat16(), bias.bfloat16()
    expected = F.layer_norm(x, (size,), weight, bias, 1e-12)
    torch.testing.assert_close(layer_norm(x, weight, bias, 1e-12), expected, atol=1e-3, rtol=2**-7)  # one bf16 step
