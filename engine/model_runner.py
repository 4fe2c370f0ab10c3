"""Turns a scheduler output into flat tensors, moves the step's KV blocks, runs the model over the
paged cache, and samples."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaForCausalLM
from engine.sampler import Sampler, SamplerOutput, SamplingRow
from engine.scheduler import SchedulerOutput
from kernels.block_copy import copy_blocks, copy_blocks_reference, swap_blocks, swap_blocks_reference
from kernels.triton_utils import TRITON_AVAILABLE

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [num_blocks, block_size, kv_heads, head_dim]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        host_kv_caches: KVCaches,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.host_kv_caches = host_kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        on_gpu = device.type == "cuda" and TRITON_AVAILABLE
        self._copy_blocks = copy_blocks if on_gpu else copy_blocks_reference
        self._swap_blocks = swap_blocks if on_gpu else swap_blocks_reference
        self.swap_seconds = 0.0  # wall time spent moving blocks between the pools

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, rows: Sequence[SamplingRow], fanout: Sequence[int] | None = None
    ) -> SamplerOutput | None:
        """Run one step. `rows` are the sampling inputs of the scheduled sequences that need a
        token, in schedule order; `fanout[i]` says how many consecutive rows sample from the i-th
        such sequence's logits (a prompt forking into n samples), 1 each when None. Returns None
        when nothing needs sampling (pure prefill chunks, or a step that only swaps out)."""
        self._move_blocks(output)
        if not output.scheduled:
            return None
        input_ids, positions, metadata, logits_indices = self._prepare(output)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        if not rows:
            return None
        logits = self.model.compute_logits(hidden[logits_indices])
        if fanout is not None and any(count != 1 for count in fanout):
            logits = logits.repeat_interleave(torch.tensor(fanout, device=logits.device), dim=0)
        return self.sampler(logits, rows)

    def _move_blocks(self, output: SchedulerOutput) -> None:
        """Swap-outs first: the blocks they vacate may be written by this very step."""
        if output.blocks_to_swap_out or output.blocks_to_swap_in:
            started = time.perf_counter()
            for pairs, source, target in (
                (output.blocks_to_swap_out, self.kv_caches, self.host_kv_caches),
                (output.blocks_to_swap_in, self.host_kv_caches, self.kv_caches),
            ):
                if pairs:
                    index = torch.tensor(pairs, dtype=torch.int64)
                    for (src_k, src_v), (dst_k, dst_v) in zip(source, target):
                        self._swap_blocks(src_k, dst_k, index)
                        self._swap_blocks(src_v, dst_v, index)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.swap_seconds += time.perf_counter() - started
        if output.blocks_to_copy:
            index = torch.tensor(output.blocks_to_copy, dtype=torch.int64, device=self.device)
            self._copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], index)

    def _prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for item in output.scheduled:
            start, table = item.start_position, item.block_table
            stop = start + item.num_new_tokens
            token_ids.extend(item.token_ids)
            positions.extend(range(start, stop))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, stop))
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(stop)
            if item.needs_sample:
                logits_indices.append(query_start_loc[-1] - 1)

        max_blocks = max(len(item.block_table) for item in output.scheduled)
        tables = [list(item.block_table) + [0] * (max_blocks - len(item.block_table)) for item in output.scheduled]
        device = self.device

        def as_tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=as_tensor(tables, torch.int32),
            slot_mapping=as_tensor(slots, torch.int64),
        )
        return (
            as_tensor(token_ids, torch.int64),
            as_tensor(positions, torch.int64),
            metadata,
            as_tensor(logits_indices, torch.int64),
        )
