"""Turns a scheduler output into flat tensors, moves the step's KV blocks, runs the model over the
paged cache (a decode step on CUDA by replaying a CUDA graph), and samples."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.dtypes import KernelBackend
from engine.kv_cache import KVCaches
from engine.models.llama import LlamaForCausalLM
from engine.sampler import Sampler, SamplerOutput, SamplingRow
from engine.scheduler import SchedulerOutput
from engine.transfer import to_device
from kernels.block_copy import copy_blocks, copy_blocks_reference, swap_blocks, swap_blocks_reference


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        host_kv_caches: KVCaches,
        block_size: int,
        device: torch.device,
        kernel_backend: KernelBackend,
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.host_kv_caches = host_kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        use_triton = kernel_backend == "triton"
        self._copy_blocks = copy_blocks if use_triton else copy_blocks_reference
        self._swap_blocks = swap_blocks if use_triton else swap_blocks_reference
        self.decode_graphs = decode_graphs
        self._swap_seconds = 0.0
        self._pending_swap_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def swap_seconds(self) -> float:
        """Time spent moving blocks between the pools. On CUDA the moves are timed by events,
        read here (outside any step) so that a step never waits for them."""
        for start, end in self._pending_swap_timings:
            end.synchronize()
            self._swap_seconds += start.elapsed_time(end) / 1000
        self._pending_swap_timings.clear()
        return self._swap_seconds

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
        if self.decode_graphs is not None and self.decode_graphs.can_run(metadata):
            hidden = self.decode_graphs.run(input_ids, positions, metadata)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        if not rows:
            return None
        logits = self.model.compute_logits(hidden[logits_indices])
        if fanout is not None and any(count != 1 for count in fanout):
            repeats = to_device(fanout, torch.int64, logits.device)
            logits = logits.repeat_interleave(repeats, dim=0, output_size=sum(fanout))  # no sync for the size
        return self.sampler(logits, rows)

    def _move_blocks(self, output: SchedulerOutput) -> None:
        """Swap-outs first: the blocks they vacate may be written by this very step."""
        if output.blocks_to_swap_out or output.blocks_to_swap_in:
            on_gpu = self.device.type == "cuda"
            if on_gpu:
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_event.record()
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
            if on_gpu:
                end_event.record()
                self._pending_swap_timings.append((start_event, end_event))
            else:
                self._swap_seconds += time.perf_counter() - started
        if output.blocks_to_copy:
            index = to_device(output.blocks_to_copy, torch.int64, self.device)
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
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=to_device(tables, torch.int32, device),
            slot_mapping=to_device(slots, torch.int64, device),
            query_start_loc_tensor=to_device(query_start_loc, torch.int32, device),
            seq_lens_tensor=to_device(seq_lens, torch.int32, device),
            max_query_len=max(item.num_new_tokens for item in output.scheduled),
        )
        return (
            to_device(token_ids, torch.int64, device),
            to_device(positions, torch.int64, device),
            metadata,
            to_device(logits_indices, torch.int64, device),
        )
