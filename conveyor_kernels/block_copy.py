"""Whole-block copies between KV cache pools: copy-on-write within a pool, and swapping between the
device pool and a host pool.

A block is one `[block_size, num_kv_heads, head_dim]` slice of a `[num_blocks, ...]` cache. The
Triton kernel takes its caches as a tensor of base addresses, so one launch serves every layer's
K and V cache at once.
"""

from __future__ import annotations

import functools

import torch

from conveyor_kernels.triton_utils import interpreter_enabled, require_triton, tl, triton

# Blocks are copied as raw words of the element's width, so any cache dtype (fp8 included) works
# and no value is ever converted.
_WORD_TYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _copy_blocks_kernel(
    src_addresses_ptr,
    dst_addresses_ptr,
    pairs_ptr,
    block_numel,
    WORD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program (pair, cache, chunk): copies CHUNK elements of block pairs[pair, 0] of source cache
    `cache` into block pairs[pair, 1] of its destination cache. Pairs go on grid axis 0, the only
    one not capped at 65535, since swapping out a long sequence moves thousands of blocks."""
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    offsets = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    src = tl.load(src_addresses_ptr + cache).to(tl.pointer_type(WORD))
    dst = tl.load(dst_addresses_ptr + cache).to(tl.pointer_type(WORD))
    src_block = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    values = tl.load(src + src_block * block_numel + offsets, mask=mask)
    tl.store(dst + dst_block * block_numel + offsets, values, mask=mask)


def _check_pool(caches: list[torch.Tensor], like: torch.Tensor) -> None:
    for cache in caches:
        if cache.shape[1:] != like.shape[1:] or cache.dtype != like.dtype:
            raise ValueError("all caches must share block shape and dtype")
        if not cache.is_contiguous():
            raise ValueError("caches must be contiguous (each block one run of memory)")


@functools.lru_cache(maxsize=16)
def _addresses(data_ptrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The caches' base addresses as a device tensor. A pool's caches never move, so this is built
    once (at the engine's warm-up) and every later step reuses it without a host-to-device copy.
    Keyed by the addresses themselves, so a cache freed and another allocated in its place still
    gets the right ones."""
    pinned = device.type == "cuda"
    return torch.tensor(data_ptrs, dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=pinned)


def _launch_copy(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], src_dst_pairs: torch.Tensor, device: torch.device
) -> None:
    """The i-th source cache's blocks go to the i-th destination cache, by one launch on `device`."""
    require_triton()
    like = src_caches[0]
    _check_pool(src_caches + dst_caches, like)
    num_pairs = src_dst_pairs.shape[0]
    if src_dst_pairs.shape != (num_pairs, 2):
        raise ValueError(f"pairs must be [N, 2], got {tuple(src_dst_pairs.shape)}")
    if num_pairs == 0:
        return
    # Already there when the caller sent them with the step's inputs; otherwise one copy here.
    pairs = src_dst_pairs.to(device=device, dtype=torch.int64).contiguous()
    src_addresses = _addresses(tuple(cache.data_ptr() for cache in src_caches), device)
    dst_addresses = _addresses(tuple(cache.data_ptr() for cache in dst_caches), device)
    block_numel = like[0].numel()
    chunk = 256 if interpreter_enabled() else 2048
    grid = (num_pairs, len(src_caches), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        src_addresses,
        dst_addresses,
        pairs,
        block_numel,
        WORD=_WORD_TYPES[like.element_size()],
        CHUNK=chunk,
        num_warps=4,
    )


def copy_blocks(
    k_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor],
    src_dst_pairs: torch.Tensor,  # [N, 2] int64: (source block, destination block)
) -> None:
    """Triton launcher, copy-on-write: in every layer's K and V cache, block dst becomes a copy of
    block src, all layers in one launch. Destinations must be distinct and not also be sources
    (the pairs are copied concurrently)."""
    caches = list(k_caches) + list(v_caches)
    if not caches:
        return
    if any(cache.device != caches[0].device for cache in caches):
        raise ValueError("copy-on-write caches must share a device")
    _launch_copy(caches, caches, src_dst_pairs, caches[0].device)


def swap_blocks(
    src_caches: list[torch.Tensor],  # per cache [num_blocks, block_size, num_kv_heads, head_dim]
    dst_caches: list[torch.Tensor],  # same block shape and dtype, possibly another device and pool size
    src_to_dst: torch.Tensor,  # [N, 2] int64: (block in each src cache, block in its dst cache)
) -> None:
    """Triton launcher: moves blocks between pools, e.g. GPU <-> host for swapping a preempted
    sequence, every cache in one launch.

    Between a GPU and the host the kernel runs on the GPU and reads or writes the host pool
    directly: pinned memory is mapped into the GPU's address space (unified addressing) at the
    same address, so the move is one launch ordered on the stream like any other, with no staging
    copy and no wait on the host. The host side must therefore be pinned.
    """
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"{len(src_caches)} source caches but {len(dst_caches)} destination caches")
    if not src_caches or src_to_dst.shape[0] == 0:
        return
    devices = {cache.device for cache in src_caches + dst_caches}
    gpus = {device for device in devices if device.type != "cpu"}
    if len(gpus) > 1:
        raise ValueError(f"blocks move between one GPU and the host, not across {sorted(map(str, gpus))}")
    if gpus and any(cache.device.type == "cpu" and not cache.is_pinned() for cache in src_caches + dst_caches):
        raise ValueError("a host pool swapped with a GPU must be pinned (the kernel addresses it directly)")
    _launch_copy(list(src_caches), list(dst_caches), src_to_dst, gpus.pop() if gpus else devices.pop())


def copy_blocks_reference(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src_dst_pairs: torch.Tensor
) -> None:
    """Plain-torch `copy_blocks`."""
    for cache in list(k_caches) + list(v_caches):
        pairs = src_dst_pairs.to(device=cache.device, dtype=torch.int64)
        cache.index_copy_(0, pairs[:, 1], cache.index_select(0, pairs[:, 0]))


def swap_blocks_reference(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], src_to_dst: torch.Tensor
) -> None:
    """Plain-torch `swap_blocks` (through a staging copy when the pools sit on different devices)."""
    if not src_caches or src_to_dst.shape[0] == 0:
        return
    src_index = src_to_dst[:, 0].to(device=src_caches[0].device, dtype=torch.int64)
    dst_index = src_to_dst[:, 1].to(device=dst_caches[0].device, dtype=torch.int64)
    for src_cache, dst_cache in zip(src_caches, dst_caches, strict=True):
        dst_cache.index_copy_(0, dst_index, src_cache.index_select(0, src_index).to(dst_cache.device))
