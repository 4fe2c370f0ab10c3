"""Triton block copy (copy-on-write) and block swap against their references."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.block_copy import copy_blocks, copy_blocks_reference, swap_blocks, swap_blocks_reference
from tests.kernels.kernel_testing import DTYPES

BLOCK_SHAPE = (16, 2, 64)  # block_size, num_kv_heads, head_dim


def _pool(num_blocks: int, dtype: torch.dtype, device: str, generator: torch.Generator) -> torch.Tensor:
    pool = torch.randn(num_blocks, *BLOCK_SHAPE, generator=generator).to(device, dtype)
    # A host pool beside a GPU is pinned, as the engine allocates it: the kernel addresses it directly.
    return pool.pin_memory() if device == "cpu" and torch.cuda.is_available() else pool


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
    """Two caches (a layer's K and V) between two pools of different sizes on one device, one launch."""
    generator = torch.Generator().manual_seed(1)
    src = [_pool(6, dtype, device, generator) for _ in range(2)]
    dst = [_pool(9, dtype, device, generator) for _ in range(2)]
    pairs = torch.tensor([[1, 8], [4, 0], [5, 2]])
    expected = [cache.clone() for cache in dst]
    untouched_src = [cache.clone() for cache in src]

    swap_blocks(src, dst, pairs)

    swap_blocks_reference(untouched_src, expected, pairs)
    for actual, wanted in zip(dst + src, expected + untouched_src):
        assert torch.equal(actual, wanted)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(("src_device", "dst_device"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_swap_blocks_between_gpu_and_host(src_device: str, dst_device: str) -> None:
    """The kernel on the GPU reading or writing the pinned host pool directly, without a host sync."""
    generator = torch.Generator().manual_seed(2)
    src = [_pool(6, torch.bfloat16, src_device, generator) for _ in range(2)]
    dst = [_pool(9, torch.bfloat16, dst_device, generator) for _ in range(2)]
    pairs = torch.tensor([[1, 8], [4, 0], [5, 2]]).cuda()
    expected = [cache.clone() for cache in dst]
    swap_blocks([src[0]], [dst[0]], pairs)  # the first launch compiles and builds the address tensors

    torch.cuda.set_sync_debug_mode("error")
    try:
        swap_blocks(src, dst, pairs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    swap_blocks_reference(src, expected, pairs)
    for actual, wanted in zip(dst, expected):
        assert torch.equal(actual, wanted)


def test_swap_refuses_an_unpinned_host_pool_beside_a_gpu() -> None:
    gpu_cache = torch.empty(2, *BLOCK_SHAPE, device="meta")
    with pytest.raises(ValueError, match="pinned"):
        swap_blocks([gpu_cache], [torch.zeros(2, *BLOCK_SHAPE)], torch.tensor([[0, 1]]))


def test_references_match_block_by_block_copies() -> None:
    generator = torch.Generator().manual_seed(3)
    src, dst = _pool(5, torch.float32, "cpu", generator), _pool(4, torch.float32, "cpu", generator)
    expected_src, expected_dst = src.clone(), dst.clone()
    expected_src[4], expected_src[1] = src[0], src[3]
    expected_dst[2] = src[0]
    copied, swapped = src.clone(), dst.clone()

    copy_blocks_reference([copied], [], torch.tensor([[0, 4], [3, 1]]))
    swap_blocks_reference([src], [swapped], torch.tensor([[0, 2]]))

    assert torch.equal(copied, expected_src)
    assert torch.equal(swapped, expected_dst)
