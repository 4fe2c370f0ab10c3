"""Llama-family decoder: Llama 2/3, Mistral, SmolLM2, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

Inputs are flat: all tokens of a step, from every sequence, in one [T] row, with their positions.
Attention goes through the paged KV cache via the attention backend; nothing here is padded.
q/k/v and gate/up projections are fused into one matmul each; `load_weights` maps the Hugging Face
checkpoint names onto them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from kernels import cpu_kernels
from kernels.activation import silu_and_mul
from kernels.rmsnorm import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary as apply_rotary_in_place

# Which kernels the layers use: plain torch, the C++ CPU kernels, or Triton (the CUDA path).
LayerKernels = Literal["torch", "cpu", "triton"]


class RMSNorm(nn.Module):
    """RMSNorm with float32 statistics, optionally fused with the residual add that precedes it.
    The C++ CPU kernel and the Triton kernel do both in one pass over contiguous inputs, updating
    the residual in place; otherwise torch's rms_norm."""

    def __init__(self, size: int, eps: float, kernels: LayerKernels = "torch") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual for the next layer) where the new residual is x + residual."""
        if self.kernels == "cpu" and x.is_contiguous():
            return cpu_kernels.rms_norm(x, residual, self.weight, self.eps), (x if residual is None else residual)
        if self.kernels == "triton" and x.is_contiguous():
            if residual is None:
                return rms_norm(x, self.weight, self.eps), x
            # x is this layer's fresh output, free to be overwritten by its normed self.
            return fused_add_rms_norm(x, residual, self.weight, self.eps, out=x, residual_out=residual)
        if residual is not None:
            x = x + residual
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x


# A batch-size hint for oneDNN's weight layout; packed weights serve any number of tokens.
_PACK_FOR_TOKENS = 64


class Linear(nn.Linear):
    """nn.Linear whose weight can be prepacked into oneDNN's blocked layout for bfloat16 on CPU:
    measured 1.5x on decode-size matmuls, where reading the weights is the cost (26 -> 17 ms for
    the 30 layers of SmolLM2 at 64 tokens). Packing keeps a second, packed copy of the weight."""

    packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_FOR_TOKENS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


@dataclass(frozen=True)
class RopeStep:
    """One step's rotary inputs, prepared once and used by every layer. The torch path indexes the
    tables once per step (cos/sin rounded to the activations' dtype, as HF does); the Triton kernel
    reads the float32 tables by position itself."""

    positions: torch.Tensor  # [T]
    cos_table: torch.Tensor  # [max_position, head_dim / 2] float32
    sin_table: torch.Tensor
    cos: torch.Tensor | None  # [T, 1, head_dim / 2] for the torch path; None on the Triton path
    sin: torch.Tensor | None

    def rotate(self, qk: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k, given side by side as one [T, heads + kv_heads, head_dim] tensor."""
        if self.cos is None or self.sin is None:
            q, k = qk.split([num_heads, qk.shape[1] - num_heads], dim=1)
            apply_rotary_in_place(q, k, self.positions, self.cos_table, self.sin_table)
            return q, k
        x1, x2 = qk.chunk(2, dim=-1)
        rotated = torch.cat((x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin), dim=-1)
        q, k = rotated.split([num_heads, qk.shape[1] - num_heads], dim=1)
        return q, k


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (first half of head_dim rotates with the second half), from
    float32 cos/sin tables over every position."""

    def __init__(self, config: ModelConfig, use_triton: bool) -> None:
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inverse_frequencies(config))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.use_triton = use_triton

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        if self.use_triton:
            return RopeStep(positions, self.cos, self.sin, None, None)
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return RopeStep(positions, self.cos, self.sin, cos, sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RopeStep,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # q and k side by side as one [T, heads + kv_heads, D] tensor: one rotary pass for both.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads])[0], self.k_norm(qk[:, self.num_heads :])[0]), dim=1)
        q, k = rope.rotate(qk, self.num_heads)
        out = self.backend(q, k, v, k_cache, v_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


# On CPU a large prefill step runs the MLP in slices of this many tokens, so its wide intermediate
# stays in the caches between the matmuls and the activation (measured 1.6x on an 8192-token step).
_CPU_MLP_SLICE_TOKENS = 2048


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, use_triton: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.shape[0] > _CPU_MLP_SLICE_TOKENS:
            return torch.cat([self._forward(part) for part in x.split(_CPU_MLP_SLICE_TOKENS)])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.use_triton:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, kernels: LayerKernels) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config, use_triton=kernels == "triton")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, k_cache, v_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, kernels: LayerKernels) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, kernels) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.rotary = RotaryEmbedding(config, use_triton=kernels == "triton")


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, kernels: LayerKernels = "torch") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, kernels)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary(positions, hidden.dtype)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, k_cache, v_cache, metadata)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        if not self.config.tie_word_embeddings:
            return self.lm_head(hidden).float()
        if self._packed_embedding is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, self._packed_embedding, None, "none", [], "").float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    _packed_embedding: torch.Tensor | None = None  # the tied output projection, packed

    def pack_linears_for_cpu(self) -> None:
        """Prepack every projection (and a tied output projection) for oneDNN; bfloat16 on CPU."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        if self.config.tie_word_embeddings:
            self._packed_embedding = torch.ops.mkldnn._reorder_linear_weight(
                self.model.embed_tokens.weight.detach(), _PACK_FOR_TOKENS
            )

    # Hugging Face checkpoint name suffix -> (our fused parameter suffix, which shard)
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def _shard_bounds(self, fused: str, shard: int) -> tuple[int, int]:
        c = self.config
        if fused == "gate_up_proj":
            return shard * c.intermediate_size, (shard + 1) * c.intermediate_size
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        starts = (0, q, q + kv, q + 2 * kv)
        return starts[shard], starts[shard + 1]

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into this model; every parameter must be covered."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        filled: dict[str, int] = {}  # fused parameter -> rows written
        for name, tensor in named_tensors:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            module_path, _, leaf = name.rpartition(".")  # leaf: "weight" or "bias"
            parent, _, proj = module_path.rpartition(".")
            if proj in self._FUSED:
                fused, shard = self._FUSED[proj]
                target = f"{parent}.{fused}.{leaf}"
                start, stop = self._shard_bounds(fused, shard)
                params[target][start:stop].copy_(tensor)
                filled[target] = filled.get(target, 0) + (stop - start)
                if filled[target] == params[target].shape[0]:
                    loaded.add(target)
                continue
            if name not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
