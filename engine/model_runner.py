"""Turns a scheduler output into flat tensors, runs the model over the paged cache, and samples."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaForCausalLM
from engine.sampler import Sampler, SamplerOutput, SamplingRow
from engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, rows: Sequence[SamplingRow]) -> SamplerOutput | None:
        """Run one step. `rows` are the sampling inputs of the scheduled sequences that need a
        token, in schedule order. Returns None when nothing needs sampling (pure prefill chunks)."""
        input_ids, positions, metadata, logits_indices = self._prepare(output)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        if not rows:
            return None
        logits = self.model.compute_logits(hidden[logits_indices])
        return self.sampler(logits, rows)

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
