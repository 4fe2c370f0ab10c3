"""The paged KV cache: per layer one preallocated [num_blocks, block_size, kv_heads, head_dim] tensor
for K and one for V, sized from a memory budget."""

from __future__ import annotations

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [num_blocks, block_size, kv_heads, head_dim]


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.tensor([], dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * element_size


def activation_bytes(model: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """An upper bound on the largest step's activations, which the KV cache must leave free on
    CUDA: per token the fused qkv output, the gate/up output and its activation, and a few hidden-
    size temporaries; plus float32 logits of every sequence, of which the sampler keeps a few copies."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    qkv = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    per_token = qkv + 3 * model.intermediate_size + 4 * model.hidden_size
    logits = 4 * config.max_num_seqs * model.vocab_size * 4
    return config.max_num_batched_tokens * per_token * element_size + logits


def num_kv_blocks(model: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Blocks that fit the budget: `kv_cache_memory` bytes on CPU; on CUDA, what is left of
    `gpu_memory_utilization` x total memory after the weights (and whatever else is resident) and
    the largest step's activations."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * config.gpu_memory_utilization) - used - activation_bytes(model, config, dtype)
    else:
        budget = config.kv_cache_memory
    blocks = budget // bytes_per_block(model, config.block_size, dtype)
    if blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) does not hold a single block")
    return blocks


def allocate_kv_cache(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    shape = (2, num_blocks, block_size, model.num_key_value_heads, model.head_dim)
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
    shape = (2, num_blocks, block_size, model.num_key_value_heads, model.head_dim)
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
