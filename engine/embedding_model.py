"""BERT-family encoder for embeddings, in plain torch, over packed (variable-length, unpadded) batches.

A batch is the token stream of its sequences laid end to end ([T] ids with per-sequence positions);
only attention needs the sequence boundaries. Where the C++ kernels run (bf16 on an AMX CPU, head_dim
32) they attend the packed rows as they are, and do the LayerNorms. Elsewhere each sequence is padded,
for attention alone, to a multiple of `ATTENTION_LENGTH_MULTIPLE` tokens (its padding keys masked) and
sequences of one padded length share one SDPA call. The projections, norms and feed-forward see every
token once.

Weights keep Hugging Face's module names but for the fused q/k/v projection; `load_weights` maps
BertModel checkpoints (with or without a `bert.` prefix) onto them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import EncoderConfig
from engine.loader import iter_safetensors
from engine.models.llama import Linear
from conveyor_kernels import cpu_kernels

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")


# torch's CPU flash attention is uneven across lengths (bf16, 4 x 12 heads x 191 tokens: 3.0 ms, x 192: 1.6 ms);
# on multiples of 16 it is fast throughout: 44 ms vs 63 ms summed over every 7th length from 16 to 254 with
# the padding masked (one thread). Padding is for attention only, so it costs little elsewhere.
ATTENTION_LENGTH_MULTIPLE = 16
KERNEL_HEAD_DIM, KERNEL_MAX_HEADS = 32, 16  # what the C++ attention kernel takes
# On CPU the feed-forward runs in slices of this many rows, as the LLM's MLP does: a whole batch's intermediate
# (8192 x 1536 bf16, 25 MB) is often handed back to the OS by the allocator and faulted in again. Sliced, the
# 1,000-chunk benchmark took 3-6% less time at 2 threads, with a fraction of the page faults.
CPU_FEED_FORWARD_ROWS = 2048


def stable_row_count(rows: int) -> int:
    """`rows` rounded up to one of 16 sizes per doubling (from 256 on, at most 1/16 more). oneDNN builds kernels per
    shape, and a batch of a size not seen before pays for that again: 8000 x 384 -> 1536 with the GELU takes
    37 ms the first time and 13 ms after (one thread), and packed batches rarely come out the same size."""
    granule = max(ATTENTION_LENGTH_MULTIPLE, 1 << max(rows.bit_length() - 5, 0))
    return -(-rows // granule) * granule


@dataclass(frozen=True)
class AttentionLayout:
    """A packed batch's sequences padded for attention and grouped by padded length, one SDPA call a group."""

    gather: torch.Tensor  # [P] the stream row behind each padded row; padding repeats row 0, masked or unused
    scatter: torch.Tensor  # [rows] the padded row of each stream row
    groups: list[tuple[int, int, torch.Tensor | None]]  # (sequences, padded length, [n, 1, 1, length] key mask)

    @classmethod
    def build(
        cls, seq_lens: Sequence[int], stream_rows: int, round_rows: Callable[[int], int], device: torch.device
    ) -> "AttentionLayout":
        """`stream_rows`: the sequences' tokens end to end, then rows that belong to no sequence; `round_rows`
        gives the padded rows' count for their own padding rows."""
        starts = list(accumulate(seq_lens, initial=0))
        by_padded_length: dict[int, list[int]] = {}
        for index, length in enumerate(seq_lens):
            padded = -(-length // ATTENTION_LENGTH_MULTIPLE) * ATTENTION_LENGTH_MULTIPLE
            by_padded_length.setdefault(padded, []).append(index)
        rows: list[int] = []
        is_token: list[bool] = []
        for padded, indices in by_padded_length.items():
            for index in indices:
                padding = padded - seq_lens[index]
                rows += [*range(starts[index], starts[index + 1]), *[0] * padding]
                is_token += [True] * seq_lens[index] + [False] * padding
        rows += [0] * (round_rows(len(rows)) - len(rows))
        gather = torch.tensor(rows, dtype=torch.int64)
        valid = torch.tensor(is_token, dtype=torch.bool)
        scatter = torch.zeros(stream_rows, dtype=torch.int64)
        scatter[gather[: len(is_token)][valid]] = valid.nonzero().squeeze(1)
        valid = valid.to(device)
        groups: list[tuple[int, int, torch.Tensor | None]] = []
        start = 0
        for padded, indices in by_padded_length.items():
            stop = start + len(indices) * padded
            unpadded = all(seq_lens[index] == padded for index in indices)
            groups.append((len(indices), padded, None if unpadded else valid[start:stop].view(-1, 1, 1, padded)))
            start = stop
        return cls(gather.to(device), scatter.to(device), groups)

    def __call__(self, qkv_proj: nn.Module, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        hidden_size = hidden.shape[1]
        # Gathering hidden, a third of q/k/v's width, costs less than the padding rows' extra projections.
        qkv = qkv_proj(hidden.index_select(0, self.gather))
        outputs: list[torch.Tensor] = []
        start = 0
        for count, length, key_mask in self.groups:
            stop = start + count * length
            # [count * length, 3 * hidden] -> three [count, heads, length, head_dim] views, no copy.
            q, k, v = qkv[start:stop].view(count, length, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
            outputs.append(attended.transpose(1, 2).reshape(stop - start, hidden_size))
            start = stop
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)).index_select(0, self.scatter)


@dataclass(frozen=True)
class KernelAttention:
    """The C++ AMX kernel's attention, straight over the packed rows (see `conveyor_kernels.cpu_kernels`)."""

    seq_starts: torch.Tensor  # [B + 1] int64 on the CPU

    @classmethod
    def build(cls, seq_lens: Sequence[int]) -> "KernelAttention":
        return cls(torch.tensor([*accumulate(seq_lens, initial=0)], dtype=torch.int64))

    def __call__(self, qkv_proj: nn.Module, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        return cpu_kernels.encoder_attention(qkv_proj(hidden), self.seq_starts, num_heads, KERNEL_HEAD_DIM**-0.5)


PackedAttention = AttentionLayout | KernelAttention


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm, or with `kernel` set the C++ one (bf16; each row read once, in 0.6x torch's time)."""

    kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return cpu_kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)


class EncoderEmbeddings(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Every input is a single text, so every token has token type 0.
        summed = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(summed + self.token_type_embeddings.weight[0])


class LinearGELU(Linear):
    """A Linear followed by GELU. Prepacked for oneDNN (bfloat16 on CPU), the GELU runs inside the matmul:
    measured 2.4x the separate pair at 8192 tokens x 384 -> 1536 (78 -> 32 ms, one thread)."""

    def __init__(self, in_features: int, out_features: int, approximation: str) -> None:
        super().__init__(in_features, out_features)
        self.approximation = approximation  # "none" (erf) or "tanh": the spelling of F.gelu and oneDNN alike

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "gelu", [], self.approximation)
        return F.gelu(F.linear(x, self.weight, self.bias), approximate=self.approximation)


class LinearAdd(Linear):
    """A Linear whose output is added to a residual; prepacked for oneDNN, the add runs inside the matmul."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed_weight, self.bias, "add")
        return F.linear(x, self.weight, self.bias) + residual


class EncoderLayer(nn.Module):
    """Self-attention then a GELU feed-forward, each followed by residual add and LayerNorm (post-LN)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv_proj = Linear(config.hidden_size, 3 * config.hidden_size)
        self.attention_output = LinearAdd(config.hidden_size, config.hidden_size)
        self.attention_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = LinearGELU(config.hidden_size, config.intermediate_size, config.gelu_approximation)
        self.output = LinearAdd(config.intermediate_size, config.hidden_size)
        self.output_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, attention: PackedAttention) -> torch.Tensor:
        hidden = self.attention_norm(self.attention_output(attention(self.qkv_proj, hidden, self.num_heads), hidden))
        if hidden.device.type == "cpu" and hidden.shape[0] > CPU_FEED_FORWARD_ROWS:
            return torch.cat([self._feed_forward(rows) for rows in hidden.split(CPU_FEED_FORWARD_ROWS)])
        return self._feed_forward(hidden)

    def _feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output_norm(self.output(self.intermediate(hidden), hidden))


class EncoderModel(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = EncoderEmbeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.cpp_kernels = False

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] the batch's sequences end to end
        positions: torch.Tensor,  # [T] each token's position within its own sequence
        seq_lens: Sequence[int],  # [B] host copy, in stream order, summing to T
    ) -> torch.Tensor:  # [T, hidden] the last layer's token embeddings
        num_tokens = input_ids.shape[0]
        rows = self._round_rows(num_tokens)
        attention: PackedAttention = (
            KernelAttention.build(seq_lens)
            if self.cpp_kernels
            else AttentionLayout.build(seq_lens, rows, self._round_rows, input_ids.device)
        )
        hidden = self.embeddings(F.pad(input_ids, (0, rows - num_tokens)), F.pad(positions, (0, rows - num_tokens)))
        for layer in self.layers:
            hidden = layer(hidden, attention)
        return hidden[:num_tokens]

    def _round_rows(self, rows: int) -> int:
        """Rows to run the projections on: only oneDNN-packed ones gain from fewer shapes, others would just pay."""
        return stable_row_count(rows) if self.layers[0].qkv_proj.packed_weight is not None else rows

    def pack_linears_for_cpu(self) -> None:
        """Prepack every projection for oneDNN; bfloat16 on CPU (see `Linear`)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()

    def use_cpp_kernels(self) -> bool:
        """From now on attend and normalize with the C++ kernels, where they run: bf16 on an AMX CPU, head_dim 32."""
        config = self.config
        self.cpp_kernels = (
            config.head_dim == KERNEL_HEAD_DIM
            and config.num_attention_heads <= KERNEL_MAX_HEADS
            and cpu_kernels.encoder_kernels_available()
        )
        for module in self.modules():
            if isinstance(module, LayerNorm):
                module.kernel = self.cpp_kernels
        return self.cpp_kernels

    # Hugging Face q/k/v projection -> which third of our fused qkv_proj it fills
    _QKV_SHARDS = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}
    # Hugging Face layer submodule -> ours
    _RENAMED = {
        "attention.output.dense": "attention_output",
        "attention.output.LayerNorm": "attention_norm",
        "intermediate.dense": "intermediate",
        "output.dense": "output",
        "output.LayerNorm": "output_norm",
    }

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face BertModel-named tensors into this model; every parameter must be covered.
        The pooler, MLM/NSP heads and the position_ids buffer are not needed for token embeddings."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | None]] = set()  # (parameter, qkv shard or None for a whole parameter)
        for hf_name, tensor in named_tensors:
            name = hf_name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.")) or name == "embeddings.position_ids":
                continue
            target, shard = self._our_name(name)
            if target not in params:
                raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
            destination = params[target] if shard is None else params[target].chunk(3)[shard]
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            loaded.add((target, shard))
        expected = {
            (name, shard) for name in params for shard in ((0, 1, 2) if ".qkv_proj." in name else (None,))
        }
        missing = sorted(f"{name}[{shard}]" if shard is not None else name for name, shard in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _our_name(self, name: str) -> tuple[str, int | None]:
        """Our parameter for a Hugging Face tensor name, and which qkv shard it fills (None: all of it)."""
        if not name.startswith("encoder.layer."):
            return name, None  # embeddings.*: the same names as Hugging Face's
        index, _, rest = name.removeprefix("encoder.layer.").partition(".")
        module_path, _, leaf = rest.rpartition(".")
        if module_path in self._QKV_SHARDS:
            return f"layers.{index}.qkv_proj.{leaf}", self._QKV_SHARDS[module_path]
        return f"layers.{index}.{self._RENAMED.get(module_path, module_path)}.{leaf}", None


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's `*.safetensors` tensors, or else those of its `pytorch_model.bin` (older exports)."""
    if any(folder.glob("*.safetensors")):
        yield from iter_safetensors(folder)
        return
    bin_path = folder / "pytorch_model.bin"
    if not bin_path.is_file():
        raise FileNotFoundError(f"{folder} has neither *.safetensors nor pytorch_model.bin weights")
    yield from torch.load(bin_path, map_location="cpu", weights_only=True, mmap=True).items()


def pool(
    token_embeddings: torch.Tensor,  # [T, hidden] float32, sequences end to end
    seq_lens: torch.Tensor,  # [B] int64 on the same device
    modes: Sequence[str],  # from POOLING_MODES; several are concatenated in the given order
) -> torch.Tensor:  # [B, hidden * len(modes)]
    """sentence-transformers' Pooling over a packed batch: every token of a sequence counts (none is padding)."""
    num_seqs, hidden = seq_lens.shape[0], token_embeddings.shape[1]
    ends = seq_lens.cumsum(0)
    segment_ids = torch.repeat_interleave(torch.arange(num_seqs, device=seq_lens.device), seq_lens)
    pooled: list[torch.Tensor] = []
    for mode in modes:
        if mode == "cls":
            pooled.append(token_embeddings[ends - seq_lens])
        elif mode == "lasttoken":
            pooled.append(token_embeddings[ends - 1])
        elif mode == "max":
            maxima = token_embeddings.new_full((num_seqs, hidden), float("-inf"))
            pooled.append(maxima.scatter_reduce_(0, segment_ids[:, None].expand(-1, hidden), token_embeddings, "amax"))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            sums = token_embeddings.new_zeros((num_seqs, hidden)).index_add_(0, segment_ids, token_embeddings)
            counts = seq_lens.unsqueeze(1).to(token_embeddings.dtype)
            pooled.append(sums / (counts if mode == "mean" else counts.sqrt()))
        else:
            raise ValueError(f"unsupported pooling mode {mode!r}; supported: {POOLING_MODES}")
    return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)
