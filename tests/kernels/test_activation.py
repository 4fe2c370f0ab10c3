"""Triton SiLU-and-mul against its reference."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.activation import silu_and_mul, silu_and_mul_reference
from tests.kernels.kernel_testing import DTYPES, poisoned, tolerance


@pytest.mark.parametrize(("num_tokens", "intermediate_size"), [(1, 64), (5, 100), (3, 200)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(
    device: str, dtype: torch.dtype, num_tokens: int, intermediate_size: int
) -> None:
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(num_tokens, 2 * intermediate_size, generator=generator)).to(device, dtype)
    out = poisoned((num_tokens, intermediate_size), dtype, device)

    assert silu_and_mul(x, out=out) is out

    torch.testing.assert_close(out, silu_and_mul_reference(x), **tolerance(dtype))


def test_reference_matches_the_formula() -> None:
    generator = torch.Generator().manual_seed(1)
    x = 3 * torch.randn(4, 2 * 50, generator=generator)
    gate, up = x.double()[:, :50], x.double()[:, 50:]
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_reference(x).double(), expected, atol=1e-5, rtol=1e-5)
