"""Triton RMSNorm (plain and fused with the residual add) against its reference."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference
from tests.kernels.kernel_testing import DTYPES, exact_or_one_ulp, poisoned, tolerance

EPS = 1e-5
# Token rows as a decoder sees them, a non power of two hidden size, and [T, heads, head_dim]
# (per-head q/k norm as in Qwen3).
SHAPES = [(1, 64), (7, 256), (5, 100), (3, 4, 128)]


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator).to(device, dtype)
    residual = torch.randn(shape, generator=generator).to(device, dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=generator)).to(device, dtype)
    return x, residual, weight


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, _, weight = _inputs(shape, dtype, device, seed=0)
    out = poisoned(shape, dtype, device)

    assert rms_norm(x, weight, EPS, out=out) is out

    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **tolerance(dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, residual, weight = _inputs(shape, dtype, device, seed=1)
    out, residual_out = poisoned(shape, dtype, device), poisoned(shape, dtype, device)

    fused_add_rms_norm(x, residual, weight, EPS, out=out, residual_out=residual_out)

    expected_out, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
    torch.testing.assert_close(out, expected_out, **tolerance(dtype))
    torch.testing.assert_close(residual_out, expected_residual, **exact_or_one_ulp(dtype, device))


def test_fused_add_rms_norm_in_place(device: str) -> None:
    """out=x, residual_out=residual: the update a decoder layer loop does."""
    x, residual, weight = _inputs((6, 128), torch.bfloat16, device, seed=2)
    expected_out, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)

    fused_add_rms_norm(x, residual, weight, EPS, out=x, residual_out=residual)

    torch.testing.assert_close(x, expected_out, **tolerance(torch.bfloat16))
    torch.testing.assert_close(residual, expected_residual, **exact_or_one_ulp(torch.bfloat16, device))


def test_reference_matches_the_formula() -> None:
    """weight * x / sqrt(mean(x^2) + eps), in float64, for float32 input."""
    x, residual, weight = _inputs((4, 96), torch.float32, "cpu", seed=3)
    summed = x.double() + residual.double()
    expected = weight.double() * summed / torch.sqrt(summed.pow(2).mean(-1, keepdim=True) + EPS)

    normed, new_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)

    torch.testing.assert_close(normed.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_residual.double(), summed, atol=1e-6, rtol=1e-6)
