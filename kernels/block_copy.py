"""Whole-block copies between KV cache pools: copy-on-write within a pool, and swapping between the
device pool and a host pool.

A block is one `[block_size, num_kv_heads, head_dim]` slice of a `[num_blocks, ...]` cache. The
Triton kernel takes its caches as a tensor of base addresses, so one launch serves every layer's
K and V cache at once.
"""

from __future__ import annotations

import torch

from kernels.triton_utils import interpreter_enabled, require_triton, tl, triton

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
        if cache.shape[1:] != like.shape[1:] or cache.dtype != like.dtype or cache.device != like.device:
            raise ValueError("all caches must share block shape, dtype and device")
        if not cache.is_contiguous():
            raise ValueError("caches must be contiguous (each block one run of memory)")


def _launch_copy(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], src_dst_pairs: torch.Tensor
) -> None:
    """The i-th source cache's blocks go to the i-th destination cache."""
    require_triton()
    like = src_caches[0]
    _check_pool(src_caches + dst_caches, like)
    num_pairs = src_dst_pairs.shape[0]
    if src_dst_pairs.shape != (num_pairs, 2):
        raise ValueError(f"pairs must be [N, 2], got {tuple(src_dst_pairs.shape)}")
    if num_pairs == 0:
        return
    device = like.device
    pairs = src_dst_pairs.to(device=device, dtype=torch.int64).contiguous()
    src_addresses = torch.tensor([cache.data_ptr() for cache in src_caches], dtype=torch.int64, device=device)
    dst_addresses = torch.tensor([cache.data_ptr() for cache in dst_caches], dtype=torch.int64, device=device)
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
    _launch_copy(caches, caches, src_dst_pairs)


def swap_blocks(
    src_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # same block shape and dtype, possibly another device and pool size
    src_to_dst: torch.Tensor,  # [N, 2] int64: (block in src_cache, block in dst_cache)
) -> None:
    """Moves blocks between pools, e.g. GPU <-> host for swapping a preempted sequence.

    Same device: one Triton launch. Different devices: plain torch, since a kernel cannot address
    the other side's memory: gather the blocks on the source device (index_select), move them in
    one transfer, through pinned host memory when a GPU is involved (so it runs at full PCIe
    speed), and scatter them on the destination (index_copy_).
    """
    if src_to_dst.shape[0] == 0:
        return
    if src_cache.device == dst_cache.device:
        _launch_copy([src_cache], [dst_cache], src_to_dst)
        return
    if src_cache.shape[1:] != dst_cache.shape[1:] or src_cache.dtype != dst_cache.dtype:
        raise ValueError("src and dst caches must share block shape and dtype")
    src_index = src_to_dst[:, 0].to(device=src_cache.device, dtype=torch.int64)
    dst_index = src_to_dst[:, 1].to(device=dst_cache.device, dtype=torch.int64)
    pinned = "cuda" in (src_cache.device.type, dst_cache.device.type)
    if src_cache.device.type == "cpu":
        staged = torch.empty((src_index.shape[0], *src_cache.shape[1:]), dtype=src_cache.dtype, pin_memory=pinned)
        torch.index_select(src_cache, 0, src_index, out=staged)
        # Safe to return before the copy lands: the caching host allocator keeps `staged` alive
        # until the stream has consumed it.
        blocks = staged.to(dst_cache.device, non_blocking=pinned)
    else:
        gathered = src_cache.index_select(0, src_index)
        if dst_cache.device.type == "cpu":
            blocks = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=pinned)
            blocks.copy_(gathered)
        else:
            blocks = gathered.to(dst_cache.device)
    dst_cache.index_copy_(0, dst_index, blocks)


def copy_blocks_reference(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src_dst_pairs: torch.Tensor
) -> None:
    """Plain-torch `copy_blocks`."""
    for cache in list(k_caches) + list(v_caches):
        pairs = src_dst_pairs.to(device=cache.device, dtype=torch.int64)
        cache.index_copy_(0, pairs[:, 1], cache.index_select(0, pairs[:, 0]))


def swap_blocks_reference(src_cache: torch.Tensor, dst_cache: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    """Plain-torch `swap_blocks`."""
    blocks = src_cache.index_select(0, src_to_dst[:, 0].to(device=src_cache.device, dtype=torch.int64))
    dst_index = src_to_dst[:, 1].to(device=dst_cache.device, dtype=torch.int64)
    dst_cache.index_copy_(0, dst_index, blocks.to(dst_cache.device))
