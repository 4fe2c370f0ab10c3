"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each is the Llama decoder (attention, q/k norms for Qwen3-MoE, rotary, norms, layer skeleton, weight
loading) whose sparse layers build a `SparseMoeBlock` in place of the dense MLP: a router picks each token's
experts (`MoeConfig` holds each family's rules), the experts run grouped by expert (`conveyor_kernels.fused_moe`:
Triton on the Triton backend, torch matmuls per expert otherwise), and Qwen2-MoE adds its shared expert,
scaled by a sigmoid gate. Dense layers (Qwen's `mlp_only_layers`, `decoder_sparse_step`) keep Llama's MLP.

Experts are stacked: `experts.gate_up_proj` [E, 2 * I, H] and `experts.down_proj` [E, H, I], the names and
layout of transformers 5's modules. Checkpoints saved by transformers (4 and 5 alike) keep one tensor per
expert and projection (`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`); they
are copied into their expert's slice at load. Already stacked tensors load as they are.

Tensor parallelism shards every expert the way the dense MLP is sharded (vLLM's default for MoE): each rank holds
its slice of every expert's intermediate dimension, the rows of gate and up (column-parallel) and the same columns
of down (row-parallel), so its grouped matmuls give a partial sum of every token's output. Qwen2-MoE's shared
expert is split the same way and its partial sum, scaled by its gate, added before the block's one all-reduce: one
collective per sparse layer, as for a dense one. The router (and the shared expert's gate) is replicated: every rank
routes the same tokens to the same experts. Why not expert parallelism (whole experts per rank): it needs the
tokens sent to the ranks of their experts and back (all-to-all), while this is the column/row scheme the dense
layers already use (engine/parallel_layers.py), reuses the grouped kernels unchanged, and keeps every rank's work
equal whatever the routing picks (a popular expert would make its rank everyone's straggler). It asks only that
the experts' intermediate size divide by the number of ranks.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.distributed import current_group
from engine.models.llama import MLP, DecoderLayer, LayerKernels, LlamaForCausalLM
from engine.parallel_layers import CheckpointPart, CheckpointTensor, Linear, full_shape, per_rank
from conveyor_kernels.fused_moe import fused_moe, grouped_moe


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights ([T, top_k] float32, [T, top_k] int64): softmax over the
    experts in float32, the top k, then, when `renormalize`, the k weights divided by their sum."""
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class Experts(nn.Module):
    """E SwiGLU experts as two stacked weights, run grouped by expert over the tokens routed to each. Sharded,
    a rank holds its slice of every expert's intermediate dimension and its output is a partial sum (see above)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, use_triton: bool) -> None:
        super().__init__()
        self.group = current_group()
        self.intermediate_size = intermediate_size  # of the whole expert
        local = per_rank(intermediate_size, self.group.size, "the experts' intermediate size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        self.use_triton = use_triton

    @torch.no_grad()
    def load(self, leaf: str, tensor: CheckpointTensor, part: CheckpointPart) -> int:
        """Copy this rank's slice of checkpoint tensor `tensor` into `leaf`: its rows of a gate or up projection,
        its columns of a down projection. `part` is (expert, 0 gate / 1 up / None down) for one expert's
        projection, as checkpoints store them; None for all experts stacked, as transformers 5's modules hold
        them. Returns the elements written."""
        num_experts, hidden, full = self.down_proj.shape[0], self.down_proj.shape[1], self.intermediate_size
        local = self.down_proj.shape[2]
        start = self.group.rank * local  # of this rank's slice, along one expert's intermediate dimension
        parameter: torch.Tensor = getattr(self, leaf)
        is_gate_up = leaf == "gate_up_proj"
        if part is None:
            expected: tuple[int, ...] = (num_experts, 2 * full, hidden) if is_gate_up else (num_experts, hidden, full)
        else:
            assert isinstance(part, tuple), "one expert's projection: (expert, gate / up / None)"
            expected = (full, hidden) if is_gate_up else (hidden, full)
        if full_shape(tensor) != expected:
            raise ValueError(f"checkpoint shape {full_shape(tensor)} != {expected} expected for experts.{leaf}")
        if part is None and is_gate_up:
            for half in (0, 1):  # gate rows, then up rows: each split alone
                rows = half * full + start
                parameter[:, half * local : (half + 1) * local].copy_(tensor[:, rows : rows + local, :])
            return parameter.numel()
        if part is None:
            parameter.copy_(tensor[:, :, start : start + local])
            return parameter.numel()
        expert, half = part
        if is_gate_up:
            assert half is not None, "an expert's gate (0) or up (1) projection"
            destination = parameter[expert, half * local : (half + 1) * local]
            destination.copy_(tensor[start : start + local])
        else:
            destination = parameter[expert]
            destination.copy_(tensor[:, start : start + local])
        return destination.numel()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        moe = fused_moe if self.use_triton else grouped_moe
        return moe(x, self.gate_up_proj, self.down_proj, weights, expert_ids)


class SparseMoeBlock(nn.Module):
    """The feed-forward part of a sparse layer: routed experts, plus Qwen2-MoE's gated shared expert; sharded, one
    all-reduce sums every rank's partial output of both."""

    def __init__(self, config: ModelConfig, kernels: LayerKernels) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None, "a sparse block needs the model's MoeConfig"
        use_triton = kernels == "triton"
        self.group = current_group()
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = Experts(moe.num_experts, config.hidden_size, moe.expert_intermediate_size, use_triton)
        self.shared_expert: MLP | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(
                config, kernels, intermediate_size=moe.shared_expert_intermediate_size, reduce_results=False
            )
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, expert_ids)
        if self.shared_expert is not None:  # its gate scales each token's whole sum, so it scales each partial sum
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.group.all_reduce(out)


class MoeDecoderLayer(DecoderLayer):
    """A Llama decoder layer whose feed-forward part is sparse where `config.moe` says so."""

    def build_mlp(self, config: ModelConfig, kernels: LayerKernels, layer_index: int) -> nn.Module:
        assert config.moe is not None
        if layer_index in config.moe.sparse_layers:
            return SparseMoeBlock(config, kernels)
        return super().build_mlp(config, kernels, layer_index)


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE and Qwen3-MoE: which layers are sparse and how they route is in `config.moe`."""

    layer_class = MoeDecoderLayer

    def __init__(self, config: ModelConfig, backend: AttentionBackend, kernels: LayerKernels = "torch") -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture} has no mixture-of-experts config")
        super().__init__(config, backend, kernels)

    # one expert's projection in a checkpoint -> (our stacked parameter, which half of gate_up; None: all)
    _EXPERT_PROJECTIONS: dict[str, tuple[str, int | None]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", None),
        "w1": ("gate_up_proj", 0),  # Mixtral's names
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", None),
    }
    _EXPERT_TENSOR = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")

    def checkpoint_destination(self, name: str) -> tuple[str, CheckpointPart]:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the sparse block
        match = self._EXPERT_TENSOR.fullmatch(name)
        if match is None:
            return super().checkpoint_destination(name)
        experts, expert_text, projection = match.groups()
        moe, expert = self.config.moe, int(expert_text)
        assert moe is not None
        if projection not in self._EXPERT_PROJECTIONS or expert >= moe.num_experts:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint ({moe.num_experts} experts)")
        stacked, half = self._EXPERT_PROJECTIONS[projection]
        return f"{experts}.{stacked}", (expert, half)
