"""The paged KV cache: per layer one preallocated [num_blocks, block_size, kv_heads, head_dim] tensor
for K and one for V, sized from a memory budget. Its dtype is the model's, or int8 (`kv_cache_dtype`, CPU) or
fp8 e4m3 (CUDA): then each (token, kv head) row is head_dim + 4 bytes, the values and their float32 scale (conveyor_kernels/kv_quant.py),
so the scales live in the blocks and every block move (swap, copy-on-write, prefix reuse) carries them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import numpy as np
import torch

from engine.config import EngineConfig, KVCacheDtype, ModelConfig
from engine.dtypes import KernelBackend
from conveyor_kernels import kv_quant

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [num_blocks, block_size, kv_heads, row]

KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype, kernel_backend: KernelBackend) -> torch.dtype:
    """The cache's storage dtype: "auto" is the model's; "int8" needs the torch (CPU) backend, whose attention
    reads int8 blocks; "fp8_e4m3" the Triton (CUDA) backend, whose kernels write and read fp8 blocks. Anything else
    fails naming what runs here: never a silent fallback to a larger cache."""
    if choice == "auto":
        return model_dtype
    if choice == "int8":
        if kernel_backend != "torch":
            raise ValueError(
                "kv_cache_dtype 'int8' runs on the CPU (torch kernel backend); "
                f"this engine uses the {kernel_backend!r} backend, where 'auto' is supported"
            )
        return torch.int8
    if choice == "fp8_e4m3":
        if kernel_backend != "triton":
            raise ValueError(
                "kv_cache_dtype 'fp8_e4m3' runs on CUDA (Triton kernel backend); "
                f"this engine uses the {kernel_backend!r} backend, where 'auto' and 'int8' are supported"
            )
        return torch.float8_e4m3fn
    raise ValueError(f"unknown kv_cache_dtype {choice!r}; use one of {list(KV_CACHE_DTYPES)}")


def cache_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, kv head) row: head_dim, and a quantized row's 4 bytes of scale."""
    return kv_quant.row_width(head_dim) if kv_quant.is_quantized(dtype) else head_dim


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.tensor([], dtype=dtype).element_size()
    row = cache_row_width(model.head_dim, dtype)
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * row * element_size


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as profiled when an engine starts, in bytes (vLLM's determine-available-memory)."""

    total: int
    weights: int  # allocated by PyTorch before the profiled step: the weights, and any other live tensors
    peak_activations: int  # the profiled step's peak allocation above `weights`
    non_torch: int  # held outside PyTorch's allocator: the CUDA context, libraries' workspaces, other processes

    def kv_cache_budget(self, utilization: float) -> int:
        return int(self.total * utilization) - (self.weights + self.peak_activations + self.non_torch)


def profile_device_memory(device: torch.device, run_largest_step: Callable[[], object]) -> DeviceMemory:
    """Runs `run_largest_step` (a throwaway step with the most tokens and sequences a step may
    have) and measures what it and everything already resident took.

    Freed blocks are handed back to the driver first: the caching allocator keeps what an engine
    built earlier in this process freed (its KV cache, a float32 build) reserved, which the
    driver's free figure would otherwise count as used. Reserved memory is PyTorch's, so what is
    used beyond it belongs to someone else."""
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_largest_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()  # the step's activations go back; measured after it, for what it set up lazily
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)
    return DeviceMemory(total=total, weights=weights, peak_activations=peak - weights, non_torch=max(0, non_torch))


def num_kv_blocks(
    model: ModelConfig, config: EngineConfig, dtype: torch.dtype, device_memory: DeviceMemory | None
) -> int:
    """Blocks that fit the budget: `num_kv_blocks` when given; on CUDA, `gpu_memory_utilization` x
    total memory less what the profile found used (weights, the largest step's activations, memory
    outside PyTorch); elsewhere `kv_cache_memory` bytes."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device_memory is not None:
        budget = device_memory.kv_cache_budget(config.gpu_memory_utilization)
    else:
        budget = config.kv_cache_memory
    blocks = budget // bytes_per_block(model, config.block_size, dtype)
    if blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) does not hold a single block")
    return blocks


def allocate_kv_cache(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    shape = (2, num_blocks, block_size, model.num_key_value_heads, cache_row_width(model.head_dim, dtype))
    return [tuple(_zeros(shape, dtype, device).unbind(0)) for _ in range(model.num_hidden_layers)]


def num_host_blocks(model: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """Blocks of the host pool that swap preemption parks sequences in: `swap_space` bytes."""
    if config.preemption_mode != "swap":
        return 0
    return config.swap_space // bytes_per_block(model, config.block_size, dtype)


def allocate_host_kv_cache(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    """The host pool mirrors the device pool's layout. Pinned when the device is a GPU, so blocks
    cross PCIe by DMA at full speed; a CPU engine's host pool is plain (lazily committed) memory."""
    if num_blocks == 0:
        return []
    shape = (2, num_blocks, block_size, model.num_key_value_heads, cache_row_width(model.head_dim, dtype))
    if device.type == "cpu":
        return [tuple(_zeros(shape, dtype, device).unbind(0)) for _ in range(model.num_hidden_layers)]
    return [tuple(torch.empty(shape, dtype=dtype, pin_memory=True).unbind(0)) for _ in range(model.num_hidden_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed, because attention reads whole blocks and masks the unused tail: uninitialised memory
    could hold NaN bit patterns, and a masked NaN still poisons the softmax. On CPU numpy's calloc
    gets pages the OS zeroes on first touch, so a large budget costs no memory until it is used
    (torch.zeros would write every page up front)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element_size = torch.tensor([], dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(int(np.prod(shape)) * element_size, dtype=np.uint8))
    return raw.view(dtype).view(shape)
