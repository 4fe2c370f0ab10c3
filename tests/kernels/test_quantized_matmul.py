"""The quantized matmul kernels against their references, on every instruction-set path this CPU runs (forced by
name: the AVX-512, AVX2 and portable builds all run on an AVX-512 machine):

- dequantization equals gguf-py's `gguf.quants.dequantize` bit for bit, for every supported GGUF type (tensors
  from gguf-py's own quantizers; random blocks for the K-quants, which gguf-py cannot quantize), and equals the
  weight-only formula for int8 / int4 groups;
- the on-the-fly matmul equals dequantize-then-matmul in float32 to rounding, at odd shapes (rows not a multiple of
  the 16-row tile nor of the 4-row micro-tile, token counts not a multiple of 4);
- `linear` (the layers' entry) in bf16 and above the dequantize threshold.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

# gguf-py is the oracle of every test here (a test dependency); a lent GPU machine, which collects tests/kernels for
# its cuda tests, does not have it.
pytest.importorskip("gguf")

from engine.quantization.weight_only import dequantize_rows_reference, quantize_rows
from kernels import quantized_matmul
from kernels.quantized_matmul import GGUF_FORMATS, best_isa, gguf_dequantize_reference, matmul_reference
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
    rows, columns = 21, 64
    weight = torch.from_numpy(random_blocks(rows, columns, "Q4_1", np.random.default_rng(2)))
    x = torch.randn(2, tokens, columns, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = quantized_matmul.linear(x, weight, GGUF_FORMATS["Q4_1"][0], 0, columns)
    expected = matmul_reference(x.reshape(-1, columns), gguf_dequantize_reference(weight, "Q4_1"))
    assert got.dtype == torch.bfloat16 and got.shape == (2, tokens, rows)
    torch.testing.assert_close(got.reshape(-1, rows).float(), expected, rtol=2e-2, atol=2e-2)


def test_a_path_the_cpu_lacks_is_refused():
    if best_isa() == "avx512":
        pytest.skip("this CPU runs every path")
    with pytest.raises(RuntimeError, match="this CPU cannot run the avx512 path"):
        quantized_matmul.dequantize(torch.zeros(1, 34, dtype=torch.uint8), GGUF_FORMATS["Q8_0"][0], 0, 32, "avx512")


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
