"""Megatron-style sharded layers: each rank holds, loads and computes its slice of a layer.

A column-parallel projection splits its output features across ranks (q/k/v heads, the gate and up halves of the
MLP): no communication, each rank keeps its own heads. The row-parallel projection after it (o, down) splits its
input features the same way, so each rank's product is a partial sum: one all-reduce makes it whole (or, with
`reduce_results=False`, the caller's one all-reduce over several partial sums: a mixture-of-experts block adds its
shared expert's to the routed experts' first, engine/models/moe.py). The
embedding and the output projection split the vocabulary: the embedding sums the rows (one all-reduce), the output
projection gathers the logits of the sampled rows on rank 0, the only rank that samples.

With a group of size 1 every layer is the plain layer and no collective runs. Weights come from checkpoint tensors
that can be sliced before they are read (safetensors slices): a rank reads its part only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import CheckpointTensor, full_shape, read_whole
from engine.distributed import TensorParallelGroup, current_group
from engine.quantization.gguf import GGUFTensor
from engine.quantization.linear_method import current_linear_method
from engine.quantization.unquantized import UnquantizedLinearMethod, dense_linear, prepack
from conveyor_kernels import quantized_matmul
from conveyor_kernels.quantized_matmul import GGUF_FORMATS

# Which piece of a parameter one checkpoint tensor fills, for the sharded layer that places this rank's slice of it:
# the index of a fused projection's part (q, k, v; gate, up), or of stacked experts (expert, part: gate 0, up 1,
# None for down); None: the whole parameter.
CheckpointPart = int | tuple[int, int | None] | None


def per_rank(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


class Linear(nn.Linear):
    """nn.Linear whose weight can be prepacked into oneDNN's blocked layout for bfloat16 on CPU (see
    engine/quantization/unquantized.py), for the layers that are never quantized: the encoder's, a MoE router.
    Packing keeps a second, packed copy of the weight."""

    packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        self.packed_weight = prepack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.packed_weight, self.bias)


class QuantizableLinear(nn.Module):
    """A projection [in_features -> out_features] whose weight layout, loading and matmul belong to the
    quantization method of the model being built (engine/quantization/): float weights, GGUF blocks or int8/int4
    groups. The bias, where there is one, stays float in the model's dtype.

    `adapter_term(x, out)`, where set (the LoRA slots, engine/lora.py), adds each row's adapter term to the output in
    place after the matmul: in a row-parallel projection before the all-reduce, so each rank's term from its slice of
    the input is a partial sum like the base's, and one all-reduce sums both."""

    adapter_term: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = current_linear_method()
        self.method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def load_piece(self, leaf: str, tensor: CheckpointTensor, index: tuple[slice, ...], rows: slice, part: int) -> int:
        """Put `tensor[index]` into output rows `rows` of `leaf` ("weight" or "bias"), as part `part` of a fused
        projection. Returns the elements written."""
        if leaf == "bias":
            assert self.bias is not None, "a bias in the checkpoint of a projection without one"
            destination = self.bias[rows]
            destination.copy_(tensor[index])
            return destination.numel()
        return self.method.load_weight(self, tensor, index, rows, part)

    def process_weights_after_loading(self, pack_for_cpu: bool) -> None:
        self.method.process_weights_after_loading(self, pack_for_cpu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        if self.adapter_term is not None:
            self.adapter_term(x, out)
        return out


class ColumnParallelLinear(QuantizableLinear):
    """Output features split across ranks: rank r holds rows [r * out / size, (r + 1) * out / size) of the weight
    (and bias), one contiguous slice per logical part (`part_sizes`, e.g. q, k and v) so each part splits alone."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool, what: str) -> None:
        self.group: TensorParallelGroup = current_group()
        self.local_part_sizes = [per_rank(size, self.group.size, what) for size in part_sizes]
        super().__init__(in_features, sum(self.local_part_sizes), bias=bias)

    @torch.no_grad()
    def load(self, leaf: str, tensor: CheckpointTensor, part: int | None) -> int:
        """Copy this rank's rows of checkpoint tensor `tensor` into `leaf`: part `part` of the fused projection (q, k
        or v; gate or up), or with `part` None all parts back to back, as checkpoints that fuse them store them
        (Phi-3). Returns the elements written."""
        size, rank = self.group.size, self.group.rank
        parts = range(len(self.local_part_sizes)) if part is None else [part]
        expected = sum(self.local_part_sizes[p] for p in parts) * size
        if full_shape(tensor)[0] != expected:
            raise ValueError(f"checkpoint rows {full_shape(tensor)[0]} != {expected} expected for this projection")
        checkpoint_start, written = 0, 0
        for p in parts:
            local = self.local_part_sizes[p]
            start = sum(self.local_part_sizes[:p])
            rows = checkpoint_start + rank * local
            written += self.load_piece(leaf, tensor, (slice(rows, rows + local),), slice(start, start + local), p)
            checkpoint_start += local * size
        return written


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v fused; each rank holds its query heads and its key/value heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        group = current_group()
        per_rank(num_heads, group.size, "num_attention_heads")
        per_rank(num_kv_heads, group.size, "num_key_value_heads")
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, "attention heads x head_dim")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate and up fused; each rank holds its slice of both, [gate_r; up_r]."""

    def __init__(self, in_features: int, intermediate_size: int) -> None:
        super().__init__(in_features, [intermediate_size, intermediate_size], False, "intermediate_size")


class RowParallelLinear(QuantizableLinear):
    """Input features split across ranks; the partial products are summed by one all-reduce, unless
    `reduce_results` is False: then the caller sums them, with others, in its own all-reduce."""

    def __init__(self, in_features: int, out_features: int, what: str, reduce_results: bool = True) -> None:
        self.group: TensorParallelGroup = current_group()
        self.reduce_results = reduce_results
        super().__init__(per_rank(in_features, self.group.size, what), out_features, bias=False)

    @torch.no_grad()
    def load(self, leaf: str, tensor: CheckpointTensor, part: int | None) -> int:
        local = self.in_features
        shape = full_shape(tensor)
        if shape != (self.out_features, local * self.group.size):
            raise ValueError(f"checkpoint shape {shape} != {(self.out_features, local * self.group.size)} expected")
        columns = slice(self.group.rank * local, (self.group.rank + 1) * local)
        return self.load_piece(leaf, tensor, (slice(None), columns), slice(0, self.out_features), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = super().forward(x)
        return self.group.all_reduce(partial) if self.reduce_results else partial


def vocab_shard(vocab_size: int, group: TensorParallelGroup) -> tuple[int, int, int]:
    """(first token id, end token id, rows held) of this rank's vocabulary slice. Every rank holds the same number
    of rows, the last one padded with zero rows when the vocabulary does not divide evenly."""
    rows = -(-vocab_size // group.size)
    start = min(group.rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def _load_vocab_rows(weight: torch.Tensor, tensor: CheckpointTensor, vocab_size: int, group: TensorParallelGroup) -> int:
    shape = full_shape(tensor)
    if shape != (vocab_size, weight.shape[1]):
        raise ValueError(f"checkpoint shape {shape} != {(vocab_size, weight.shape[1])} expected")
    start, end, _ = vocab_shard(vocab_size, group)
    with torch.no_grad():
        weight[: end - start].copy_(tensor[start:end])
        weight[end - start :].zero_()
    return weight.numel()


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks: each rank looks up the ids it holds (zeros for the
    others) and one all-reduce sums the rows. A GGUF's quantized embedding keeps its blocks instead of `weight`
    (`blocks`, uint8 [rows, row_bytes] of GGUF format `format_id`), and a lookup dequantizes the rows it reads to
    the same values a float copy would hold, at the blocks' bytes. The embedding of a tied output projection that
    runs quantized holds nothing of its own: `read_rows_from` the projection, whose quantized rows it dequantizes
    (one matrix in memory, as llama.cpp keeps it)."""

    blocks: torch.Tensor | None = None
    format_id: int | None = None
    # ids [n] -> float32 rows [n, hidden] of the tied output projection (read_rows_from); None: weight or blocks
    shared_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.group = current_group()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.start, self.end, rows = vocab_shard(vocab_size, self.group)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.dtype = torch.get_default_dtype()

    def load(self, leaf: str, tensor: CheckpointTensor, part: int | None) -> int:
        if not isinstance(tensor, GGUFTensor):
            return _load_vocab_rows(self.weight, tensor, self.vocab_size, self.group)
        shape = full_shape(tensor)
        if shape != (self.vocab_size, self.hidden_size):
            raise ValueError(f"checkpoint shape {shape} != {(self.vocab_size, self.hidden_size)} expected")
        # Only the ranks' own rows: ids beyond them are masked before the lookup, the padding rows never read.
        self.blocks = tensor.blocks((slice(self.start, self.end),)).contiguous()
        self.format_id = GGUF_FORMATS[tensor.type_name][0]
        rows = self.weight.shape[0]
        del self.weight
        return rows * self.hidden_size

    def read_rows_from(self, head: ParallelLMHead) -> None:
        """Look rows up in the tied output projection `head` (quantized; the same vocabulary rows on this rank),
        dropping this embedding's own matrix."""
        self.shared_rows = functools.partial(head.method.dequantize_rows, head)
        del self.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self._rows(input_ids)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local_ids = (input_ids - self.start).masked_fill_(outside, 0)
        rows = self._rows(local_ids).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(rows)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shared_rows is not None:
            rows = self.shared_rows(ids.reshape(-1)).to(self.dtype)
        elif self.blocks is not None:
            rows = quantized_matmul.dequantize_rows(self.blocks, ids.reshape(-1), self.format_id, 0, self.hidden_size)
            rows = rows.to(self.dtype)
        else:
            return F.embedding(ids, self.weight)
        return rows.reshape(*ids.shape, self.hidden_size)


class ParallelLMHead(QuantizableLinear):
    """The output projection with the vocabulary split as in VocabParallelEmbedding; `gather_logits` assembles
    the full rows on rank 0."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.group = current_group()
        self.vocab_size = vocab_size
        super().__init__(hidden_size, vocab_shard(vocab_size, self.group)[2], bias=False)

    @torch.no_grad()
    def load(self, leaf: str, tensor: CheckpointTensor, part: int | None) -> int:
        shape = full_shape(tensor)
        if shape != (self.vocab_size, self.in_features):
            raise ValueError(f"checkpoint shape {shape} != {(self.vocab_size, self.in_features)} expected")
        start, end, rows = vocab_shard(self.vocab_size, self.group)
        if end - start < rows:  # the last rank's padding rows: zero logits, dropped by gather_logits
            if not isinstance(self.method, UnquantizedLinearMethod):
                raise ValueError(
                    f"a quantized output projection needs a vocabulary ({self.vocab_size}) divisible by "
                    f"tensor_parallel_size ({self.group.size})"
                )
            self.weight[end - start :].zero_()
        written = self.load_piece(leaf, tensor, (slice(start, end),), slice(0, end - start), 0)
        return written + (rows - (end - start)) * self.in_features


def gather_logits(local_logits: torch.Tensor, vocab_size: int, group: TensorParallelGroup) -> torch.Tensor | None:
    """[N, vocab] float32 logits on rank 0 from each rank's [N, vocab / size] slice (the padding dropped);
    None on the other ranks. Called with only the rows that are sampled, so little crosses between ranks."""
    logits = group.gather_to_first(local_logits)
    if logits is None:
        return None
    return logits[:, :vocab_size].float()
