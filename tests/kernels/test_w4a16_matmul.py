"""The Triton W4A16 GEMM (AWQ / GPTQ on CUDA) against dequantize-then-matmul, at tiny odd shapes: token counts and
output features not multiples of the tiles, input features of 3 groups; zero points up to 16 (GPTQ v1)."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.w4a16 import Int4Piece, dequantize_piece
from conveyor_kernels.w4a16_matmul import dequantize, pack, w4a16_matmul, w4a16_matmul_reference


def _weights(n: int, k: int, group: int, seed: int) -> tuple[Int4Piece, tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    zeros = torch.randint(0, 17, (n, k // group), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3).half().float()
    piece = Int4Piece(q, zeros, scales, torch.arange(k) // group)
    return piece, pack(q, zeros, scales)


def test_pack_dequantizes_to_the_formula():
    piece, packed = _weights(37, 96, 32, 0)
    assert torch.equal(dequantize(*packed, 32), dequantize_piece(piece))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "group"), [(3, 37, 96, 32), (17, 21, 192, 64)])
def test_w4a16_matmul_matches_dequantize_then_matmul(device, dtype, m, n, k, group):
    _, packed = _weights(n, k, group, m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    reference = w4a16_matmul_reference(x, *packed, group)
    got = w4a16_matmul(x.to(device), *(t.to(device) for t in packed), group)
    assert got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), reference, rtol=tolerance, atol=tolerance * k ** 0.5)
