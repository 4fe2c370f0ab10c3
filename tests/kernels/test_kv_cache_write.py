"""Triton KV cache write against its reference."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference
from tests.kernels.kernel_testing import DTYPES, exact_or_one_ulp


def _slots(num_tokens: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct random slots, every third token padding (-1)."""
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[::3] = -1
    return slots


@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_matches_reference(device: str, dtype: torch.dtype, head_dim: int, num_kv_heads: int) -> None:
    """key/value are slices of a fused qkv projection, as the model hands them over."""
    generator = torch.Generator().manual_seed(0)
    num_tokens, num_heads, num_blocks, block_size = 7, 4, 5, 16
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(device, dtype)
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    slots = _slots(num_tokens, num_blocks * block_size, generator).to(device)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(device, dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    write_kv_cache(key, value, k_cache, v_cache, slots)

    write_kv_cache_reference(key, value, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_write_casts_to_the_cache_dtype(device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    key = torch.randn(6, 2, 64, generator=generator).to(device)
    value = torch.randn(6, 2, 64, generator=generator).to(device)
    slots = torch.tensor([15, 16, -1, 0, 47, 31], device=device)  # either side of block boundaries
    k_cache = torch.randn(3, 16, 2, 64, generator=generator).to(device, torch.bfloat16)
    v_cache = torch.randn(3, 16, 2, 64, generator=generator).to(device, torch.bfloat16)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    write_kv_cache(key, value, k_cache, v_cache, slots)

    write_kv_cache_reference(key, value, expected_k, expected_v, slots)
    torch.testing.assert_close(k_cache, expected_k, **exact_or_one_ulp(torch.bfloat16, device))
    torch.testing.assert_close(v_cache, expected_v, **exact_or_one_ulp(torch.bfloat16, device))


def test_reference_matches_slot_by_slot_copy() -> None:
    generator = torch.Generator().manual_seed(2)
    key = torch.randn(5, 2, 8, generator=generator)
    value = torch.randn(5, 2, 8, generator=generator)
    slots = torch.tensor([3, -1, 16, 9, -1])
    k_cache, v_cache = torch.randn(2, 16, 2, 8, generator=generator), torch.randn(2, 16, 2, 8, generator=generator)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // 16, slot % 16] = key[token]
            expected_v[slot // 16, slot % 16] = value[token]

    write_kv_cache_reference(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
