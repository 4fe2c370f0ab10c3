"""Decode steps replayed from CUDA graphs.

A decode step of a small model is a few hundred short kernels, and launching them from Python
costs more than running them. So each batch-size bucket's decode forward pass is captured once
as a CUDA graph over static input buffers; a decode step copies its inputs into the buffers,
pads its batch up to the next bucket, and replays. Padding rows carry slot -1 (no cache write)
and context length 0 (attention reads nothing and returns zeros), so they touch no real state;
their outputs are dropped. Steps with prefill chunks, and batches above the largest bucket, run
eagerly.

Every launch inside the forward pass must take its shapes from host-known sizes: the decode
kernel sizes its KV split from the block-table width, which is fixed here at the longest
sequence the engine admits, so a captured launch fits every later replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCaches
from engine.models.llama import LlamaForCausalLM


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_batch_size: padding a
    batch costs at most 15 rows of mostly-idle work, and each bucket is one more graph to keep."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch_size]
    sizes += range(16, max_batch_size, 16)
    return sizes + [max_batch_size]


def capture_graph(forward: Callable[[], None], pool: tuple[int, int] | None) -> torch.cuda.CUDAGraph:
    """`forward`'s kernels captured as a CUDA graph, in the memory pool `pool` (None: a new one).
    The only place that touches the CUDA graph API; tests put an eager stand-in here."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        forward()
    torch.cuda.synchronize()
    return graph


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        max_batch_size: int,  # sequences in the largest captured decode step
        max_blocks_per_seq: int,  # block-table width: the longest admitted sequence, in blocks
        device: torch.device,
    ) -> None:
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        rows = self.batch_sizes[-1]
        hidden_size = model.config.hidden_size
        dtype = model.model.embed_tokens.weight.dtype
        with torch.device(device):
            self.input_ids = torch.zeros(rows, dtype=torch.int64)
            self.positions = torch.zeros(rows, dtype=torch.int64)
            self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64)
            self.seq_lens = torch.zeros(rows, dtype=torch.int32)
            self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32)
            self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32)
            self.hidden = torch.zeros(rows, hidden_size, dtype=dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(model, kv_caches)

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=list(range(batch_size + 1)),
            seq_lens=[0] * batch_size,  # host copy unused by the Triton backend; the device copy is filled per replay
            block_tables=self.block_tables[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc_tensor=self.query_start_loc[: batch_size + 1],
            seq_lens_tensor=self.seq_lens[:batch_size],
            max_query_len=1,
        )

    @torch.inference_mode()
    def _capture(self, model: LlamaForCausalLM, kv_caches: KVCaches) -> None:
        """Largest bucket first, so the smaller graphs fit in the memory pool the first one made.
        The buffers hold slot -1 and length 0 meanwhile, so capture writes no KV cache."""
        pool = None
        for size in reversed(self.batch_sizes):
            metadata = self._metadata(size)

            def forward(size: int = size, metadata: AttentionMetadata = metadata) -> None:
                self.hidden[:size] = model(self.input_ids[:size], self.positions[:size], kv_caches, metadata)

            # An eager run first compiles this shape's Triton kernels, which capture cannot do.
            forward()
            self.graphs[size] = capture_graph(forward, pool)
            pool = self.graphs[size].pool()

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return metadata.max_query_len == 1 and len(metadata.seq_lens) <= self.batch_sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The decode step's hidden states [B, hidden]: a view of the static output, valid until
        the next replay."""
        batch = input_ids.shape[0]
        size = next(size for size in self.batch_sizes if size >= batch)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(metadata.slot_mapping)
        self.slot_mapping[batch:size].fill_(-1)
        self.seq_lens[:batch].copy_(metadata.seq_lens_tensor)
        self.seq_lens[batch:size].fill_(0)
        # Entries past a row's table are never read: its length bounds the blocks attention visits.
        self.block_tables[:batch, : metadata.block_tables.shape[1]].copy_(metadata.block_tables)
        self.graphs[size].replay()
        return self.hidden[:batch]
