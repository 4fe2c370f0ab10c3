"""Triton block copy (copy-on-write) and block swap against their references."""

from __future__ import annotations

import pytest
import torch

from kernels.block_copy import copy_blocks, copy_blocks_reference, swap_blocks, swap_blocks_reference
from tests.kernels.kernel_testing import DTYPES

BLOCK_SHAPE = (16, 2, 64)  # block_size, num_kv_heads, head_dim


def _pool(num_blocks: int, dtype: torch.dtype, device: str, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(num_blocks, *BLOCK_SHAPE, generator=generator).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(device: str, dtype: torch.dtype) -> None:
    """Three layers' K and V caches in one launch; the other blocks must not change."""
    generator = torch.Generator().manual_seed(0)
    k_caches = [_pool(8, dtype, device, generator) for _ in range(3)]
    v_caches = [_pool(8, dtype, device, generator) for _ in range(3)]
    pairs = torch.tensor([[0, 3], [5, 1], [2, 7]])
    expected_k = [cache.clone() for cache in k_caches]
    expected_v = [cache.clone() for cache in v_caches]

    copy_blocks(k_caches, v_caches, pairs)

    copy_blocks_reference(expected_k, expected_v, pairs)
    for actual, expected in zip(k_caches + v_caches, expected_k + expected_v):
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_within_a_device_matches_reference(device: str, dtype: torch.dtype) -> None:
    """Between two pools of different sizes on one device (the Triton path)."""
    generator = torch.Generator().manual_seed(1)
    src, dst = _pool(6, dtype, device, generator), _pool(9, dtype, device, generator)
    pairs = torch.tensor([[1, 8], [4, 0], [5, 2]])
    expected = dst.clone()
    untouched_src = src.clone()

    swap_blocks(src, dst, pairs)

    swap_blocks_reference(untouched_src, expected, pairs)
    assert torch.equal(dst, expected)
    assert torch.equal(src, untouched_src)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(("src_device", "dst_device"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_swap_blocks_between_gpu_and_host(src_device: str, dst_device: str) -> None:
    """The torch path through pinned host memory."""
    generator = torch.Generator().manual_seed(2)
    src = _pool(6, torch.bfloat16, src_device, generator)
    dst = _pool(9, torch.bfloat16, dst_device, generator)
    pairs = torch.tensor([[1, 8], [4, 0], [5, 2]])
    expected = dst.clone()

    swap_blocks(src, dst, pairs)
    torch.cuda.synchronize()

    swap_blocks_reference(src, expected, pairs)
    assert torch.equal(dst, expected)


def test_references_match_block_by_block_copies() -> None:
    generator = torch.Generator().manual_seed(3)
    src, dst = _pool(5, torch.float32, "cpu", generator), _pool(4, torch.float32, "cpu", generator)
    expected_src, expected_dst = src.clone(), dst.clone()
    expected_src[4], expected_src[1] = src[0], src[3]
    expected_dst[2] = src[0]
    copied, swapped = src.clone(), dst.clone()

    copy_blocks_reference([copied], [], torch.tensor([[0, 4], [3, 1]]))
    swap_blocks_reference(src, swapped, torch.tensor([[0, 2]]))

    assert torch.equal(copied, expected_src)
    assert torch.equal(swapped, expected_dst)
