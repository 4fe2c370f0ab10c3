"""The attention seam: what the model hands to attention each layer, and the backends behind it.

The model computes q/k/v; a backend writes the new k/v into the paged cache and attends through
the block tables. The torch backend is the CPU path and the reference the Triton kernels are
tested against; the Triton backend is the CUDA path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from conveyor_kernels import cpu_kernels, kv_quant
from conveyor_kernels.decode_attention import decode_attention
from conveyor_kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference
from conveyor_kernels.paged_attention import PagedAttentionPlan, plan_paged_attention, run_paged_attention
from conveyor_kernels.prefill_attention import prefill_attention


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch layout, shared by every layer."""

    query_start_loc: list[int]  # [B + 1] host copy: sequence i owns query rows [qsl[i], qsl[i+1])
    seq_lens: list[int]  # [B] host copy: context length after this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32 on the device, padded with 0
    slot_mapping: torch.Tensor  # [T] int64 on the device: cache slot of each new token, -1 = none
    query_start_loc_tensor: torch.Tensor  # [B + 1] int32 on the device
    seq_lens_tensor: torch.Tensor  # [B] int32 on the device; 0 marks a padding row (CUDA graphs)
    max_query_len: int  # new tokens of the longest chunk; 1 = a decode-only step
    # (sequence index, start, stop): prompt positions [start, stop) of sequence i whose tokens attend to each other
    # both ways (an image's placeholders, Gemma 3), each ending within this step's chunk of that sequence
    bidirectional_spans: tuple[tuple[int, int, int], ...] = ()
    # [T] int32 on the device, with spans only: each new token's first unseen key position (its position + 1, or its
    # span's stop), as the Triton prefill kernel takes them; None without spans
    span_key_limits: torch.Tensor | None = None


class AttentionBackend(Protocol):
    def __call__(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,  # sliding window: a query at position p attends keys in (p - window, p]
        softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) before the softmax
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]


class TorchAttention:
    """The CPU path: torch ops, with the K/V writes, decode rows and (bf16 on AVX-512 BF16) prefill chunks in the
    C++ kernels where they could be built. An int8 cache (conveyor_kernels/kv_quant.py) gets the new K/V quantized per
    (token, kv head); its decode rows are dequantized on the fly by the C++ kernels (AVX-512 / AVX2 / portable), its
    prefill chunks by the bf16 prefill kernel as it packs them (bf16 on AVX-512 BF16), else by torch.
    Plans the batch layout once per step and kind of layer (window, soft-capping) on the first layer
    that sees the step's metadata, and reuses the plan in every other layer of that kind."""

    def __init__(self, use_cpu_kernels: bool, shared_prefix_min_saved_tokens: int = 0) -> None:
        self.use_cpu_kernels = use_cpu_kernels
        self.shared_prefix_min_saved_tokens = shared_prefix_min_saved_tokens
        self._planned_for: AttentionMetadata | None = None
        self._plans: dict[tuple[int | None, bool], PagedAttentionPlan] = {}

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if self._planned_for is not metadata:
            self._plans.clear()
            self._planned_for = metadata
        kind = (window, softcap is not None)
        plan = self._plans.get(kind)
        if plan is None:
            # The shared-prefix groups attend through torch's flash kernel, which neither windows nor
            # soft-caps: such layers attend those rows one by one.
            shared_prefix = self.shared_prefix_min_saved_tokens if window is None and softcap is None else 0
            plan = self._plans[kind] = plan_paged_attention(
                metadata.query_start_loc,
                metadata.seq_lens,
                metadata.block_tables,
                k_cache.shape[1],
                use_decode_kernel=self.use_cpu_kernels,
                shared_prefix_min_saved_tokens=shared_prefix,
                window=window,
                # The prefill kernel has no soft-capping nor bidirectional spans, and reads bf16 caches and int8 ones
                # (bf16 queries).
                use_prefill_kernel=self.use_cpu_kernels
                and softcap is None
                and not metadata.bidirectional_spans
                and k_cache.dtype in (query.dtype, torch.int8)
                and cpu_kernels.prefill_attention_available(query.dtype, query.shape[-1]),
                bidirectional_spans=metadata.bidirectional_spans,
            )
        if k_cache.dtype == torch.int8:
            # Every read is of the quantized values, a prefill's own new K/V included: what a later chunk, a
            # prefix-cache hit or a swapped-in sequence reads is then exactly what the first pass attended.
            key, value = kv_quant.quantize(key, torch.int8), kv_quant.quantize(value, torch.int8)
        if self.use_cpu_kernels:
            cpu_kernels.write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        else:
            write_kv_cache_reference(key, value, k_cache, v_cache, metadata.slot_mapping)
        if k_cache.dtype == torch.int8:
            key, value = kv_quant.dequantize(key, query.dtype), kv_quant.dequantize(value, query.dtype)
        return run_paged_attention(
            query, k_cache, v_cache, plan, scale, new_key=key, new_value=value, softcap=softcap
        )



class TritonAttention:
    """The CUDA path: new K/V go to their slots, then one launch attends for the whole batch. A
    decode-only step uses the split-KV decode kernel; a step with prefill chunks uses the varlen
    prefill kernel for every row, decode rows included. Launch shapes depend only on host-known
    sizes, never on device values, so a decode step can be captured in a CUDA graph. Bidirectional
    spans reach the prefill kernel as each token's key limit; a decode row never needs one (a span's
    last token sees the span causally)."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.max_query_len == 1:
            return decode_attention(
                query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens_tensor, scale, out=out,
                window=window, softcap=softcap,
            )
        return prefill_attention(
            query,
            k_cache,
            v_cache,
            metadata.query_start_loc_tensor,
            metadata.seq_lens_tensor,
            metadata.block_tables,
            scale,
            metadata.max_query_len,
            out=out,
            window=window,
            softcap=softcap,
            key_limits=metadata.span_key_limits,
        )
