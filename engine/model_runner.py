"""Turns a scheduler output into flat tensors, moves the step's KV blocks, runs the model over the
paged cache (a decode step on CUDA by replaying a CUDA graph), and samples."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.dtypes import KernelBackend
from engine.kv_cache import KVCaches
from engine.lora import LoRAAdapter, LoRASlotWeights
from engine.models.llama import LlamaForCausalLM
from engine.multimodal.encoder_step import EncoderStep
from engine.multimodal.positions import chunk_positions
from engine.prompt_logprobs import PromptLogprobs, score_prompts
from engine.sampler import Sampler, SamplerOutput, SamplingRow
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.transfer import to_device
from conveyor_kernels.block_copy import copy_blocks, copy_blocks_reference, swap_blocks, swap_blocks_reference
from conveyor_kernels.decode_attention import table_widths_per_variant
from conveyor_kernels.prefill_attention import chunk_lengths_per_tile


@dataclass
class StepResult:
    """What one step computed for the engine to read: the sampled tokens and the prompt log-probs asked for."""

    sampled: SamplerOutput | None  # None when no row sampled (prefill chunks only, or a rank other than the first)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # seq id -> this step's


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        host_kv_caches: KVCaches,
        block_size: int,
        device: torch.device,
        kernel_backend: KernelBackend,
        vision: EncoderStep | None = None,
        lora: LoRASlotWeights | None = None,
    ) -> None:
        self.model = model
        self.vision = vision  # a vision-language model's encoder pass; None for a text-only model
        self.kv_caches = kv_caches
        self.host_kv_caches = host_kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(cpu_kernels=model.kernels == "cpu")
        use_triton = kernel_backend == "triton"
        self._key_limits_on_device = use_triton  # the Triton prefill kernel reads bidirectional spans as key limits
        self._copy_blocks = copy_blocks if use_triton else copy_blocks_reference
        self._swap_blocks = swap_blocks if use_triton else swap_blocks_reference
        self.decode_graphs: DecodeGraphs | None = None  # set once captured, after the warm-up
        self._swap_seconds = 0.0
        self._pending_swap_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.adapters: dict[str, LoRAAdapter] = {}  # registered LoRA adapters, by name (host memory)
        # the device's adapter slots (enable_lora), allocated by the shard's builder before the KV cache is sized
        self.lora = lora

    def register_adapter(self, adapter: LoRAAdapter) -> None:
        """Make `adapter` loadable into a slot (the engine was built with enable_lora)."""
        assert self.lora is not None, "adapters need the slots enable_lora allocates"
        self.adapters[adapter.name] = adapter

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
        self,
        output: SchedulerOutput,
        rows: Sequence[SamplingRow],
        fanout: Sequence[int] | None = None,
        token_bitmask: Future[torch.Tensor | None] | None = None,
    ) -> StepResult:
        """Run one step. `rows` are the sampling inputs of the scheduled sequences that need a
        token, in schedule order; `fanout[i]` says how many consecutive rows sample from the i-th
        such sequence's logits (a prompt forking into n samples), 1 each when None; `token_bitmask`
        the grammar's allowed tokens per row (structured output), still being filled while the model runs (the
        sampler waits for it); None when no row has one. Nothing is
        sampled when no sequence needs a token (pure prefill chunks, or a step that only swaps out), nor on
        tensor-parallel ranks other than the first, which pass no rows."""
        self._move_blocks(output)
        if not output.scheduled:
            return StepResult(None)
        input_ids, positions, metadata, logits_indices = self._prepare(output)
        with_adapters = self._begin_adapters(output)
        embeds = None
        if self.vision is not None and any(item.images for item in output.scheduled):
            embeds = self.vision.embed(self.model.embed, input_ids, output.scheduled, metadata.query_start_loc)
        try:
            # A captured graph holds no adapter terms nor image rows: such a step runs eagerly.
            eager = with_adapters or embeds is not None
            if self.decode_graphs is not None and not eager and self.decode_graphs.can_run(metadata):
                hidden = self.decode_graphs.run(input_ids, positions, metadata)
            elif embeds is not None:
                hidden = self.model(input_ids, positions, self.kv_caches, metadata, inputs_embeds=embeds)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        prompt_logprobs = score_prompts(self.model.compute_logits, hidden, output.scheduled, metadata.query_start_loc)
        if not any(item.needs_sample for item in output.scheduled):
            return StepResult(None, prompt_logprobs)
        logits = self.model.compute_logits(hidden[logits_indices])
        if logits is None:  # a tensor-parallel rank other than the first: rank 0 samples
            return StepResult(None)
        if fanout is not None and any(count != 1 for count in fanout):
            repeats = to_device(fanout, torch.int64, logits.device)
            logits = logits.repeat_interleave(repeats, dim=0, output_size=sum(fanout))  # no sync for the size
        bitmask = token_bitmask.result() if token_bitmask is not None else None
        return StepResult(self.sampler(logits, rows, bitmask), prompt_logprobs)

    def _begin_adapters(self, output: SchedulerOutput) -> bool:
        """Load the adapters the scheduler placed in new slots and tell the layers each token's slot. Returns whether
        any row of the step runs an adapter."""
        if self.lora is None:
            return False
        for slot, name in output.adapter_loads:
            self.lora.load(slot, self.adapters[name])
        token_slots = [item.adapter_slot for item in output.scheduled for _ in range(item.num_new_tokens)]
        return self.lora.begin_step(token_slots, self.device)

    @torch.inference_mode()
    def run_dummy_step(self, query_lens: Sequence[int], blocks_per_seq: int, sample_rows: Sequence[SamplingRow] = ()) -> None:
        """A throwaway step: sequences of `query_lens` new tokens each (a context of just those
        tokens) through tables `blocks_per_seq` wide of block 0. Nothing is written to the cache
        (slot -1); attention reads block 0, whatever it holds. With `sample_rows` (one per
        sequence) it samples too. For warm-ups and the start-up memory profile."""
        num_tokens = sum(query_lens)
        query_start_loc = list(accumulate(query_lens, initial=0))
        device = self.device
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=list(query_lens),
            block_tables=torch.zeros(len(query_lens), blocks_per_seq, dtype=torch.int32, device=device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            query_start_loc_tensor=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens_tensor=torch.tensor(query_lens, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
        )
        token_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.cat([torch.arange(length, device=device) for length in query_lens])
        hidden = self.model(token_ids, positions, self.kv_caches, metadata)
        if sample_rows:
            last_tokens = torch.tensor(query_start_loc[1:], device=device) - 1
            logits = self.model.compute_logits(hidden[last_tokens])  # a collective: every rank computes it
            if logits is not None:  # rank 0 of a tensor-parallel group samples, the others get None
                self.sampler(logits, sample_rows)

    def warm_up(self, max_num_batched_tokens: int, max_blocks_per_seq: int) -> None:
        """Compiles every Triton kernel variant a step can launch, so that no compile lands inside
        a running engine: a prefill step per query-tile height, a decode step per split variant,
        and a block copy and swaps (which also build their address tensors once). The varying
        integer arguments are not specialised on (`do_not_specialize`), so one launch per
        variant covers every batch."""
        config = self.model.config
        k_cache = self.kv_caches[0][0]
        # The heads this runner's cache holds: a tensor-parallel rank's share of the model's.
        num_kv_heads = k_cache.shape[2]
        num_heads = num_kv_heads * (config.num_attention_heads // config.num_key_value_heads)
        max_chunk = min(max_num_batched_tokens, max_blocks_per_seq * self.block_size)
        for query_len in chunk_lengths_per_tile(num_heads, num_kv_heads, max_chunk):
            self.run_dummy_step([query_len], -(-query_len // self.block_size))
        # The kernels hold K/V tiles in the activations' dtype (a quantized cache's rows dequantized into it).
        activation_size = self.model.model.norm.weight.element_size()
        for width in table_widths_per_variant(
            num_kv_heads, config.head_dim, activation_size, self.block_size,
            max_blocks_per_seq, self.device,
        ):
            self.run_dummy_step([1], width)
        # Block 0 onto itself (copy-on-write), and out to the host pool and back: nothing changes.
        self._move_blocks(SchedulerOutput(scheduled=(), blocks_to_copy=((0, 0),)))
        if self.host_kv_caches:
            self._move_blocks(SchedulerOutput(scheduled=(), blocks_to_swap_out=((0, 0),)))
            self._move_blocks(SchedulerOutput(scheduled=(), blocks_to_swap_in=((0, 0),)))
            self._pending_swap_timings.clear()  # not swaps the engine's metrics should count
            self._swap_seconds = 0.0

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
                    # One index transfer and one launch per direction, every layer's K and V at once.
                    index = to_device(pairs, torch.int64, self.device)
                    self._swap_blocks([c for layer in source for c in layer], [c for layer in target for c in layer], index)
            if on_gpu:
                end_event.record()
                self._pending_swap_timings.append((start_event, end_event))
            else:
                self._swap_seconds += time.perf_counter() - started
        if output.blocks_to_copy:
            index = to_device(output.blocks_to_copy, torch.int64, self.device)
            self._copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], index)

    def _positions(self, flat: list[int], grids: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """The step's positions: [T], or [3, T] (temporal, height, width; a text token's three equal) when a chunk
        holds image placeholders with grid positions, for a decoder with M-RoPE."""
        if not grids:
            return to_device(flat, torch.int64, self.device)
        positions = torch.tensor(flat, dtype=torch.int64).expand(3, -1).clone()
        for index, rows in grids:
            positions[:, index : index + rows.shape[1]] = rows
        return positions.to(self.device)

    def _prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        grid_positions: list[tuple[int, torch.Tensor]] = []  # (step token index, [3, n]): M-RoPE placeholders
        spans: list[tuple[int, int, int]] = []  # (sequence index, start, stop): bidirectional image spans
        for index, item in enumerate(output.scheduled):
            start, table = item.start_position, item.block_table
            stop = start + item.num_new_tokens
            spans.extend((index, image.offset, image.stop) for image in item.images if image.bidirectional)
            token_ids.extend(item.token_ids)
            if item.long_rope:
                positions.extend(self.model.long_rope_rows(range(start, stop)))
            elif item.images or item.position_shift:
                flat, grids = chunk_positions(start, stop, item.position_shift, item.images)
                grid_positions.extend((len(positions) + at, rows) for at, rows in grids)
                positions.extend(flat)
            else:
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
            bidirectional_spans=tuple(spans),
            span_key_limits=(
                to_device(_key_limits(output.scheduled), torch.int32, device)
                if spans and self._key_limits_on_device else None
            ),
        )
        return (
            to_device(token_ids, torch.int64, device),
            self._positions(positions, grid_positions),
            metadata,
            to_device(logits_indices, torch.int64, device),
        )


def _key_limits(scheduled: Sequence[ScheduledSequence]) -> list[int]:
    """Each new token's first unseen key position, as the Triton prefill kernel takes them: its position + 1, or the
    stop of the bidirectional image span it lies in (which ends within its chunk)."""
    limits: list[int] = []
    for item in scheduled:
        start = item.start_position
        row = list(range(start + 1, start + item.num_new_tokens + 1))
        for image in item.images:
            if image.bidirectional:
                first = max(image.offset, start)
                row[first - start : image.stop - start] = [image.stop] * (image.stop - first)
        limits.extend(row)
    return limits
