"""The quantized matmul kernels against their references, on every instruction-set path this CPU runs (forced by
name: the AVX-512, AVX2 and portable builds all run on an AVX-512 machine):

- dequantization equals gguf-py's `gguf.quants.dequantize` bit for bit, for every supported GGUF type (tensors
  from gguf-py's own quantizers; random blocks for the K-quants, which gguf-py cannot quantize), and equals the
  weight-only formula for int8 / int4 groups;
- the on-the-fly matmul equals dequantize-then-matmul in float32 to rounding, at odd shapes (rows not a multiple of
  the 16-row tile nor of the 4-row micro-tile, token counts not a multiple of 4);
- the bf16 path (AVX-512 BF16, bf16 x) multiplies exactly the dequantized weights rounded to bf16 (one-hot x reads
  them back bit for bit) and equals the float32 matmul of those to float32 rounding, every format, odd shapes,
  tokens 1..33; `auto` takes it for bf16 x only;
- `linear` (the layers' entry) in bf16 and above the dequantize threshold;
- int8 activations (`matmul_int8` on `pack_int8`'s layout): every format, on every path (portable C++, AVX2's
  vpmaddubsw with the 8-bit formats' sign trick, AVX-512 VNNI), against the float64 product of the quantized x and
  the dequantized weight; halves rounded to even as torch.round; "avx512" is not an int8 path and is refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

# gguf-py is the oracle of every test here (a test dependency); a lent GPU machine, which collects tests/kernels for
# its cuda tests, does not have it.
pytest.importorskip("gguf")

from engine.quantization.weight_only import dequantize_rows_reference, quantize_rows
from conveyor_kernels import quantized_matmul
from conveyor_kernels.quantized_matmul import (
    GGUF_FORMATS,
    best_isa,
    gguf_dequantize_reference,
    has_avx512_bf16,
    matmul_bf16_reference,
    matmul_reference,
)
from tests.engine.test_quantized_models import random_blocks

_ORDER = ("portable", "avx2", "avx512")


def _paths() -> list[str]:
    return list(_ORDER[: _ORDER.index(best_isa()) + 1])


@pytest.mark.parametrize("type_name", list(GGUF_FORMATS))
def test_gguf_dequantize_and_matmul_match_gguf_py(type_name):
    rng = np.random.default_rng(1)
    format_id, block_values, _ = GGUF_FORMATS[type_name]
    rows, columns = 37, 3 * block_values
    weight = torch.from_numpy(np.ascontiguousarray(random_blocks(rows, columns, type_name, rng)))
    expected = gguf_dequantize_reference(weight, type_name)
    for tokens in (1, 7):
        x = torch.randn(tokens, columns, generator=torch.Generator().manual_seed(tokens))
        reference = matmul_reference(x, expected)
        for isa in _paths():
            assert torch.equal(quantized_matmul.dequantize(weight, format_id, 0, columns, isa), expected), isa
            got = quantized_matmul.matmul(x, weight, format_id, 0, isa)
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5 * columns ** 0.5, msg=isa)


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_kernels_match_the_formula(bits):
    group, rows, columns = 32, 29, 96
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(bits))
    blocks = quantize_rows(weight, bits, group)
    expected = dequantize_rows_reference(blocks, bits, group, columns)
    # the quantization's error: at most half a step of each group's scale
    steps = weight.reshape(rows, -1, group).abs().amax(-1, keepdim=True) / (127 if bits == 8 else 7)
    assert ((expected - weight).reshape(rows, -1, group).abs() <= steps / 2 + 1e-6).all()
    format_id = quantized_matmul.INT8 if bits == 8 else quantized_matmul.INT4
    x = torch.randn(5, columns, generator=torch.Generator().manual_seed(0))
    for isa in _paths():
        assert torch.equal(quantized_matmul.dequantize(blocks, format_id, group, columns, isa), expected), isa
        torch.testing.assert_close(quantized_matmul.matmul(x, blocks, format_id, group, isa),
                                   matmul_reference(x, expected), rtol=1e-5, atol=1e-4, msg=isa)


@pytest.mark.parametrize("tokens", [3, quantized_matmul.DEQUANTIZE_ABOVE_TOKENS + 5])
def test_linear_in_bf16_on_both_sides_of_the_threshold(tokens):
    """Both sides multiply the bf16-rounded weights where the CPU has AVX-512 BF16 (one numeric behaviour for a bf16
    run); without it the kernel's side multiplies the float32 ones. Tolerance: one bf16 step of the output (2^-7)."""
    rows, columns = 21, 64
    weight = torch.from_numpy(random_blocks(rows, columns, "Q4_1", np.random.default_rng(2)))
    x = torch.randn(2, tokens, columns, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = quantized_matmul.linear(x, weight, GGUF_FORMATS["Q4_1"][0], 0, columns)
    dequantized = gguf_dequantize_reference(weight, "Q4_1")
    bf16_weights = tokens * 2 > quantized_matmul.DEQUANTIZE_ABOVE_TOKENS or has_avx512_bf16()
    reference = matmul_bf16_reference if bf16_weights else matmul_reference
    expected = reference(x.reshape(-1, columns), dequantized)
    assert got.dtype == torch.bfloat16 and got.shape == (2, tokens, rows)
    torch.testing.assert_close(got.reshape(-1, rows).float(), expected, rtol=2**-7, atol=1e-5)


# Every format of the kernels, as (name, format id, group, columns, blocks of `rows` rows): GGUF's from gguf-py's
# quantizers (random blocks for the K-quants); int8 / int4 groups of 8 over 40 columns (a row not whole 32s: the
# bf16 path's masked tail); AWQ / GPTQ groups of 32.
def _every_format(rows: int) -> list[tuple[str, int, int, int, torch.Tensor]]:
    rng = np.random.default_rng(4)
    cases = []
    for name, (format_id, block_values, _) in GGUF_FORMATS.items():
        columns = 3 * block_values
        cases.append((name, format_id, 0, columns, torch.from_numpy(random_blocks(rows, columns, name, rng))))
    weight = torch.randn(rows, 40, generator=torch.Generator().manual_seed(5))
    cases.append(("INT8", quantized_matmul.INT8, 8, 40, quantize_rows(weight, 8, 8)))
    cases.append(("INT4", quantized_matmul.INT4, 8, 40, quantize_rows(weight, 4, 8)))
    from engine.quantization.w4a16 import Int4Piece, pack_uint4_zp

    generator = torch.Generator().manual_seed(6)
    piece = Int4Piece(torch.randint(0, 16, (rows, 96), generator=generator, dtype=torch.uint8),
                      torch.randint(0, 17, (rows, 3), generator=generator, dtype=torch.uint8),
                      (torch.rand(rows, 3, generator=generator) * 0.02 + 1e-3).half().float(), torch.arange(96) // 32)
    cases.append(("UINT4_ZP", quantized_matmul.UINT4_ZP, 32, 96, pack_uint4_zp(piece, 32)))
    return cases


@pytest.fixture
def bf16_path():
    if not has_avx512_bf16():
        pytest.skip("this CPU lacks AVX-512 BF16 (lscpu: avx512_bf16), so it has no avx512_bf16 path; bf16 x takes "
                    "the float32 paths, tested above")


@pytest.mark.parametrize("case", _every_format(37), ids=lambda case: case[0])
def test_bf16_path_multiplies_the_bf16_rounded_weights(case, bf16_path):
    """37 rows (two 16-row tiles and 5 rows: 4 + 1), tokens 1..33 (4 at a time and every remainder). The weights are
    exactly `dequantize(w).to(bf16)`: x one-hot (each product exact, the rest +0) reads them back bit for bit. Against
    the float32 matmul of bf16 x and those weights: every product is exact in float32, so the two differ only by
    the order of the float32 sums (the kernel's 16 lanes of pairs, then the lanes): tolerance rtol 1e-5 and
    1e-5 * sqrt(columns) absolute, as the float32 paths'."""
    name, format_id, group, columns, weight = case
    dequantized = quantized_matmul.dequantize(weight, format_id, group, columns)
    one_hot = torch.eye(columns, dtype=torch.bfloat16)
    got = quantized_matmul.matmul(one_hot, weight, format_id, group, "avx512_bf16")
    assert torch.equal(got, dequantized.to(torch.bfloat16).float().T)
    generator = torch.Generator().manual_seed(7)
    for tokens in range(1, 34):
        x = torch.randn(tokens, columns, generator=generator).bfloat16()
        got = quantized_matmul.matmul(x, weight, format_id, group, "avx512_bf16")
        torch.testing.assert_close(got, matmul_bf16_reference(x, dequantized), rtol=1e-5,
                                   atol=1e-5 * columns ** 0.5, msg=f"{name}, {tokens} tokens")
        assert torch.equal(quantized_matmul.matmul(x, weight, format_id, group), got)  # what auto takes for bf16 x


def test_bf16_x_without_the_bf16_path_takes_float32():
    """Asked for a float32 path, or `auto` on a CPU without AVX-512 BF16: x to float32, the float32 weights, the
    same numbers as float32 x; float32 x never takes the bf16 path."""
    weight = torch.from_numpy(random_blocks(21, 64, "Q8_0", np.random.default_rng(8)))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    format_id = GGUF_FORMATS["Q8_0"][0]
    for isa in _paths():
        assert torch.equal(quantized_matmul.matmul(x, weight, format_id, 0, isa),
                           quantized_matmul.matmul(x.float(), weight, format_id, 0, isa)), isa
    assert torch.equal(quantized_matmul.matmul(x.float(), weight, format_id, 0),
                       quantized_matmul.matmul(x.float(), weight, format_id, 0, best_isa()))
    if not has_avx512_bf16():
        assert torch.equal(quantized_matmul.matmul(x, weight, format_id, 0),
                           quantized_matmul.matmul(x.float(), weight, format_id, 0, best_isa()))
    with pytest.raises(RuntimeError, match="the avx512_bf16 path multiplies bf16 x"):
        quantized_matmul.matmul(x.float(), weight, format_id, 0, "avx512_bf16")


def test_a_path_the_cpu_lacks_is_refused():
    if has_avx512_bf16():
        pytest.skip("this CPU runs every path")
    weight, format_id = torch.zeros(1, 34, dtype=torch.uint8), GGUF_FORMATS["Q8_0"][0]
    with pytest.raises(RuntimeError, match="this CPU cannot run the avx512_bf16 path"):
        quantized_matmul.matmul(torch.zeros(1, 32, dtype=torch.bfloat16), weight, format_id, 0, "avx512_bf16")
    if best_isa() != "avx512":
        with pytest.raises(RuntimeError, match="this CPU cannot run the avx512 path"):
            quantized_matmul.dequantize(weight, format_id, 0, 32, "avx512")


@pytest.mark.parametrize("group", [32, 64, 128])
def test_uint4_zero_point_groups_match_the_awq_gptq_formula(group):
    """AWQ / GPTQ groups repacked (engine/quantization/w4a16.py): dequantization is exactly (q - z) * s in float32
    (zero points 0..16: GPTQ v1's stored 15 reads 16), the matmul dequantize-then-matmul, at odd shapes."""
    from engine.quantization.w4a16 import Int4Piece, dequantize_piece, pack_uint4_zp

    rows, columns = 37, 3 * group
    generator = torch.Generator().manual_seed(group)
    q = torch.randint(0, 16, (rows, columns), generator=generator, dtype=torch.uint8)
    zeros = torch.randint(0, 17, (rows, 3), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(rows, 3, generator=generator) * 0.02 + 1e-3).half().float()
    piece = Int4Piece(q, zeros, scales, torch.arange(columns) // group)
    blocks = pack_uint4_zp(piece, group)
    assert blocks.shape == (rows, 3 * (5 + group // 2))
    expected = dequantize_piece(piece)
    for tokens in (1, 7):
        x = torch.randn(tokens, columns, generator=generator)
        for isa in _paths():
            assert torch.equal(quantized_matmul.dequantize(blocks, quantized_matmul.UINT4_ZP, group, columns, isa), expected)
            got = quantized_matmul.matmul(x, blocks, quantized_matmul.UINT4_ZP, group, isa)
            torch.testing.assert_close(got, matmul_reference(x, expected), rtol=1e-5, atol=1e-5 * columns ** 0.5)


# int8 activations (matmul_int8): every format as the kernels pack it, rows over several 16-row tiles and a partial
# one, columns past one 512-column chunk where the format allows it (the chunks' partial sums add up).
def _int8_formats(rows: int) -> list[tuple[str, int, int, int, torch.Tensor]]:
    rng = np.random.default_rng(7)
    cases = []
    for name, (format_id, block_values, _) in GGUF_FORMATS.items():
        columns = 21 * block_values if block_values == 32 else 3 * block_values
        cases.append((name, format_id, 0, columns, torch.from_numpy(random_blocks(rows, columns, name, rng))))
    weight = torch.randn(rows, 192, generator=torch.Generator().manual_seed(8))
    cases.append(("INT8", quantized_matmul.INT8, 64, 192, quantize_rows(weight, 8, 64)))
    cases.append(("INT4", quantized_matmul.INT4, 32, 192, quantize_rows(weight, 4, 32)))
    uint4_zp = next(case for case in _every_format(rows) if case[0] == "UINT4_ZP")
    return cases + [uint4_zp]


def _int8_paths() -> list[str]:
    extra = {"amx_int8": ["avx512_vnni", "amx_int8"], "avx512_vnni": ["avx512_vnni"]}
    return [p for p in _paths() if p != "avx512"] + extra.get(quantized_matmul.int8_path(), [])


@pytest.mark.parametrize("case", _int8_formats(37), ids=lambda case: case[0])
def test_int8_activations_match_the_quantized_product(case):
    """Against the float64 product of x's int8 quants times their scales and the dequantized weights
    (matmul_int8_reference), on every path, 1, 6, 15 and 35 tokens (every pass size: 8 or 4, then 4, 3, 2, 1; AMX's
    groups: fewer than 16, two of 16 and a rest), float32 and bf16 x. Every integer sum is exact, so the two differ by
    a few float32 roundings of each sub-block's term: 1e-5 of the sum of the products' magnitudes. A quant rounded
    differently moves a term by a whole quant step (1/127 of its block's largest), far past that."""
    name, format_id, group, columns, weight = case
    dequantized = quantized_matmul.dequantize(weight, format_id, group, columns)
    packed = quantized_matmul.pack_int8(weight, format_id, group, columns)
    generator = torch.Generator().manual_seed(9)
    for tokens, dtype in ((1, torch.float32), (6, torch.bfloat16), (15, torch.float32), (35, torch.bfloat16)):
        x = torch.randn(tokens, columns, generator=generator).to(dtype)
        quants, scales = quantized_matmul.quantize_activations_reference(x)
        magnitudes = (quants.abs().double().reshape(tokens, -1, 32) * scales.double()[..., None]).reshape(tokens, columns)
        bound = 1e-5 * (magnitudes @ dequantized.double().abs().T).float() + 1e-30
        expected = quantized_matmul.matmul_int8_reference(x, dequantized)
        for isa in _int8_paths():
            got = quantized_matmul.matmul_int8(x, packed, isa)
            assert got.shape == (tokens, 37) and got.dtype == torch.float32
            assert ((got - expected).abs() <= bound).all(), (isa, tokens, (got - expected).abs().max())


@pytest.mark.skipif(quantized_matmul.int8_path() != "amx_int8", reason="needs AMX-INT8 tiles the kernel lends")
@pytest.mark.parametrize("case", _int8_formats(37), ids=lambda case: case[0])
def test_amx_tokens_are_the_same_alone_and_batched(case):
    """A token's outputs are the same bit for bit alone (a step that few goes to the VNNI body) and in a step of 35
    tokens on AMX tiles (two groups of 16 under one tile configuration, the 3 left under another, their epilogue
    passes of 2 and 1): both scale each token's exact sub-block sums with the same operations in one order."""
    name, format_id, group, columns, weight = case
    packed = quantized_matmul.pack_int8(weight, format_id, group, columns)
    x = torch.randn(35, columns, generator=torch.Generator().manual_seed(10))
    batched = quantized_matmul.matmul_int8(x, packed, "amx_int8")
    for token in (0, 17, 34):
        assert torch.equal(quantized_matmul.matmul_int8(x[token : token + 1], packed, "amx_int8")[0], batched[token])


@pytest.mark.parametrize("case", _int8_formats(37), ids=lambda case: case[0])
def test_int8_repack_rows_are_the_dequantized_rows(case):
    """A packed weight's rows read back (a tied embedding's lookups) are exactly the blocks' dequantized values,
    in any order and repeated; an id past the rows is refused."""
    name, format_id, group, columns, weight = case
    packed = quantized_matmul.pack_int8(weight, format_id, group, columns)
    ids = torch.tensor([36, 0, 17, 16, 17, 5])
    assert torch.equal(packed.dequantize_rows(ids), quantized_matmul.dequantize(weight, format_id, group, columns)[ids])
    with pytest.raises(RuntimeError, match="outside the weight"):
        packed.dequantize_rows(torch.tensor([48]))


# The largest quant each format's repack holds (u = q + 128 for the 8-bit ones): the AVX2 path adds several int16
# pair sums before widening them, as many as stay inside int16 at these extremes.
_LARGEST_QUANT = {"Q4_0": 15, "Q4_1": 15, "Q4_K": 15, "INT4": 15, "UINT4_ZP": 15, "Q5_0": 31, "Q5_1": 31,
                  "Q5_K": 31, "Q6_K": 63, "Q8_0": 255, "INT8": 255}


@pytest.mark.parametrize("case", _int8_formats(37), ids=lambda case: case[0])
def test_int8_activations_at_the_extremes_of_the_integer_sums(case):
    """Every quant at its format's largest magnitude (both signs for the 8-bit formats) and every x quant at +-127:
    each integer sum is at its largest, and every path still equals the float64 product."""
    name, format_id, group, columns, weight = case
    packed = quantized_matmul.pack_int8(weight, format_id, group, columns)
    largest = _LARGEST_QUANT[name]
    fills = [0, 255] if largest == 255 else [largest | largest << 4 if largest == 15 else largest]
    x = torch.ones(3, columns)
    x[1] = -1
    x[2, ::2] = -1
    for fill in fills:
        extreme = dataclasses.replace(packed, quants=torch.full_like(packed.quants, fill))
        dequantized = extreme.dequantize_rows(torch.arange(37))
        expected = quantized_matmul.matmul_int8_reference(x, dequantized)
        for isa in _int8_paths():
            torch.testing.assert_close(quantized_matmul.matmul_int8(x, extreme, isa), expected, rtol=1e-5, atol=1e-5,
                                       msg=f"{isa}, quants {fill}")


def test_int8_activations_round_halves_to_even():
    """One block whose largest magnitude is 127 (scale exactly 1) and whose other values are halves: the quants are
    torch.round's, halves to even (2.5 -> 2, 3.5 -> 4, -2.5 -> -2), read back through an identity weight (int8 groups
    of 32: each row one 1, its group's scale 1 / 127)."""
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, -126.5])
    identity = quantize_rows(torch.eye(32), 8, 32)
    dequantized = quantized_matmul.dequantize(identity, quantized_matmul.INT8, 32, 32)
    packed = quantized_matmul.pack_int8(identity, quantized_matmul.INT8, 32, 32)
    for isa in _int8_paths():
        got = quantized_matmul.matmul_int8(x, packed, isa)
        torch.testing.assert_close(got, quantized_matmul.matmul_int8_reference(x, dequantized), rtol=1e-6, atol=0)
        torch.testing.assert_close(got[0, :6], torch.tensor([127.0, 2.0, 4.0, -2.0, 0.0, -126.0]) * dequantized[0, 0],
                                   rtol=1e-6, atol=0)


def test_int8_activations_refuse_a_path_they_do_not_have():
    weight = quantize_rows(torch.randn(16, 32), 8, 32)
    packed = quantized_matmul.pack_int8(weight, quantized_matmul.INT8, 32, 32)
    with pytest.raises(RuntimeError, match="paths are auto, amx_int8, avx512_vnni, avx2 and portable"):
        quantized_matmul.matmul_int8(torch.randn(1, 32), packed, "avx512")


def test_int8_activations_refuse_groups_that_split_their_blocks():
    weight = quantize_rows(torch.randn(4, 64), 8, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quantized_matmul.pack_int8(weight, quantized_matmul.INT8, 16, 64)


def test_linear_of_a_packed_weight_quantizes_every_step():
    """`linear` with a weight packed by pack_int8 runs matmul_int8 at any step size (here past the dequantize
    threshold) and returns x's dtype and shape."""
    name, format_id, group, columns, weight = _int8_formats(20)[4]  # Q8_0
    packed = quantized_matmul.pack_int8(weight, format_id, group, columns)
    x = torch.randn(2, 40, columns, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    got = quantized_matmul.linear(x, packed, format_id, group, columns)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 40, 20)
    assert torch.equal(got.reshape(80, 20), quantized_matmul.matmul_int8(x.reshape(80, columns), packed).to(torch.bfloat16))
