"""Triton rotary embedding against its reference."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.rotary import apply_rotary, apply_rotary_reference
from tests.kernels.kernel_testing import DTYPES, GQA_SHAPES, tolerance

MAX_POSITION = 64


def _cos_sin(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference(
    device: str, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    """q and k are slices of a fused qkv projection; v, the slice after them, must stay as it was."""
    generator = torch.Generator().manual_seed(0)
    num_tokens = 6
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(device, dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    positions = torch.tensor([0, 1, 15, 16, 17, MAX_POSITION - 1], device=device)
    cos, sin = (cache.to(device) for cache in _cos_sin(head_dim))
    expected = qkv.clone()
    expected_q, expected_k = expected[:, :num_heads], expected[:, num_heads : num_heads + num_kv_heads]

    apply_rotary(q, k, positions, cos, sin)

    apply_rotary_reference(expected_q, expected_k, positions, cos, sin)
    torch.testing.assert_close(qkv, expected, **tolerance(dtype))
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], expected[:, num_heads + num_kv_heads :])


def test_reference_is_a_complex_rotation() -> None:
    """rotate_half pairs dimension i with i + head_dim/2: as a complex number x_i + i x_{i+D/2},
    position p multiplies it by exp(i p inv_freq_i)."""
    generator = torch.Generator().manual_seed(1)
    head_dim = 64
    q = torch.randn(5, 4, head_dim, generator=generator)
    k = torch.randn(5, 2, head_dim, generator=generator)
    positions = torch.tensor([0, 3, 17, 40, 63])
    cos, sin = _cos_sin(head_dim)
    rotation = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[positions].unsqueeze(1)

    def rotated(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.complex(x[..., : head_dim // 2], x[..., head_dim // 2 :]) * rotation
        return torch.cat((pairs.real, pairs.imag), dim=-1)

    expected_q, expected_k = rotated(q), rotated(k)
    apply_rotary_reference(q, k, positions, cos, sin)

    torch.testing.assert_close(q, expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, expected_k, atol=1e-5, rtol=1e-5)
