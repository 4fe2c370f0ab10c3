"""Llama-family decoder: Llama 2/3, Mistral, SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and Phi-3
(whose checkpoints already fuse qkv_proj and gate_up_proj; LongRoPE: see RotaryEmbedding and the scheduler),
each with the sliding windows its config gives (`ModelConfig.layer_windows`). Its parts are reused by the
other families (models/gemma.py, models/moe.py).

Inputs are flat: all tokens of a step, from every sequence, in one [T] row, with their positions.
Attention goes through the paged KV cache via the attention backend; nothing here is padded.
q/k/v and gate/up projections are fused into one matmul each; `load_weights` maps the Hugging Face
checkpoint names onto them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.distributed import current_group
from engine.quantization.linear_method import current_quantization
from engine.quantization.unquantized import prepack
from engine.parallel_layers import (
    CheckpointPart,
    CheckpointTensor,
    Linear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    QuantizableLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
    read_whole,
)
from conveyor_kernels import cpu_kernels
from conveyor_kernels.activation import silu_and_mul
from conveyor_kernels.rmsnorm import fused_add_rms_norm, rms_norm
from conveyor_kernels.rotary import apply_rotary as apply_rotary_in_place

# Which kernels the layers use: plain torch, the C++ CPU kernels, or Triton (the CUDA path).
LayerKernels = Literal["torch", "cpu", "triton"]
# The dtypes whose rotary the C++ kernel computes, rounding as the torch ops do (float32 too: bit for bit the oracle's
# expression), and whose SwiGLU activation it computes; float32 keeps torch's silu, whose exp the kernel's would
# differ from in the last bit.
_CPU_ROTARY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CPU_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


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


def rope_inverse_frequencies(
    dim: int, theta: float, scaling: dict[str, Any] | None, long_factors: bool = False
) -> torch.Tensor:
    """The inverse frequencies transformers computes for `scaling`; LongRoPE's short factors, or with
    `long_factors` its long ones (`ModelConfig` gives LongRoPE's dict as "longrope", whatever its config said)."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "longrope":
        factors = scaling["long_factor" if long_factors else "short_factor"]
        if len(factors) != dim // 2:
            raise ValueError(f"LongRoPE needs head_dim / 2 = {dim // 2} long and short factors, got {len(factors)}")
        # Divided by the factor before the inversion, as transformers computes it (the same float32 rounding).
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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
    if kind == "yarn":
        # Interpolated (divided by factor) below a ramp between the dimensions that turn beta_slow and
        # beta_fast times over the original context, extrapolated (unchanged) above it, as transformers does.
        factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3, yarn, longrope (su)")


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (so attention logits grow with the stretch); 1 otherwise."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "longrope":  # the same for the short and the long factors
        factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(factor: float, weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


@dataclass(frozen=True)
class RopeStep:
    """One step's rotary inputs, prepared once and used by every layer. The torch path indexes the
    tables once per step (cos/sin rounded to the activations' dtype, as HF does); the Triton kernel
    reads the float32 tables by position itself. With `in_place` the C++ CPU kernel rotates q and k
    where they lie, rounding as the torch path does."""

    positions: torch.Tensor  # [T]
    cos_table: torch.Tensor  # [max_position, head_dim / 2] float32
    sin_table: torch.Tensor
    cos: torch.Tensor | None  # [T, 1, head_dim / 2] for the torch path; None on the Triton path
    sin: torch.Tensor | None
    in_place: bool = False

    def rotate(self, qk: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k, given side by side as one [T, heads + kv_heads, head_dim] tensor."""
        if self.cos is None or self.sin is None:
            q, k = qk.split([num_heads, qk.shape[1] - num_heads], dim=1)
            apply_rotary_in_place(q, k, self.positions, self.cos_table, self.sin_table)
            return q, k
        if self.in_place:
            cpu_kernels.rotary_in_place(qk, self.cos, self.sin)
            return qk[:, :num_heads], qk[:, num_heads:]
        x1, x2 = qk.chunk(2, dim=-1)
        rotated = torch.cat((x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin), dim=-1)
        q, k = rotated.split([num_heads, qk.shape[1] - num_heads], dim=1)
        return q, k


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (first half of head_dim rotates with the second half), from
    float32 cos/sin tables over every position.

    The tables' rows are what the model's `positions` index. With LongRoPE they hold every position twice:
    rows [0, max_position_embeddings) rotated with the short factors, the next as many with the long ones, and a
    sequence on the long factors passes its positions plus max_position_embeddings (`long_rope_rows`). Each
    sequence of a step reads its own half, so one step mixes short and long sequences, CUDA graphs included."""

    def __init__(self, config: ModelConfig, kernels: LayerKernels, local: bool = False) -> None:
        """`local`: the sliding-window layers' own unscaled rotation at `local_rope_theta` (Gemma 3)."""
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        if local:
            assert config.local_rope_theta is not None
            inv_freqs = [rope_inverse_frequencies(config.head_dim, config.local_rope_theta, None)]
            attention_factor = 1.0
        else:
            inv_freqs = [rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)]
            if config.long_rope_threshold is not None:
                inv_freqs.append(rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling, True))
            attention_factor = rope_attention_factor(config.rope_scaling)
        freqs = torch.cat([torch.outer(positions, inv_freq) for inv_freq in inv_freqs])
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)
        self.kernels = kernels
        # M-RoPE: which of a token's (temporal, height, width) positions each frequency turns by
        axes = [axis for axis, size in enumerate(config.mrope_section or ()) for _ in range(size)]
        self.register_buffer("mrope_axes", torch.tensor(axes, dtype=torch.int64), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        """`positions`: [T], or [3, T] (M-RoPE: each frequency of a token turns by one of its three positions, as
        transformers' `mrope_section` splits them; a step without image placeholders passes [T], all three equal)."""
        if positions.dim() == 2:  # the torch rotation on every backend (the Triton kernel reads one position)
            axes = self.mrope_axes.expand(1, positions.shape[1], -1)
            cos, sin = self.cos[positions].gather(0, axes)[0], self.sin[positions].gather(0, axes)[0]
        elif self.kernels == "triton":
            return RopeStep(positions, self.cos, self.sin, None, None)
        else:
            cos, sin = self.cos[positions], self.sin[positions]
        in_place = self.kernels == "cpu" and dtype in _CPU_ROTARY_DTYPES
        return RopeStep(positions, self.cos, self.sin, cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype), in_place)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer_index: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        )
        # This rank's heads: all of them unless the model is sharded (tensor parallelism).
        self.q_size, self.kv_size, _ = self.qkv_proj.local_part_sizes
        self.num_heads = self.q_size // self.head_dim
        self.num_kv_heads = self.kv_size // self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = config.layer_windows[layer_index] if config.layer_windows else None
        self.softcap = config.attn_logit_softcapping
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, "attention heads")
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
        out = self.backend(q, k, v, k_cache, v_cache, metadata, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


# On CPU a large prefill step runs the MLP in slices of this many tokens, so its wide intermediate
# stays in the caches between the matmuls and the activation (measured 1.6x on an 8192-token step).
_CPU_MLP_SLICE_TOKENS = 2048


class MLP(nn.Module):
    """Gated MLP: down(act(gate) * up), with SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma).
    `intermediate_size` overrides the config's width, and `reduce_results=False` leaves a sharded MLP's output
    this rank's partial sum (a MoE model's shared expert: its block sums everything in one all-reduce)."""

    def __init__(
        self, config: ModelConfig, kernels: LayerKernels, intermediate_size: int | None = None, reduce_results: bool = True
    ) -> None:
        super().__init__()
        width = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, width)
        self.down_proj = RowParallelLinear(width, config.hidden_size, "intermediate_size", reduce_results)
        self.kernels = kernels
        self.gelu = config.hidden_activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.shape[0] > _CPU_MLP_SLICE_TOKENS:
            return torch.cat([self._forward(part) for part in x.split(_CPU_MLP_SLICE_TOKENS)])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels == "triton" and not self.gelu:
            return self.down_proj(silu_and_mul(gate_up))
        if self.kernels == "cpu" and not self.gelu and gate_up.dtype in _CPU_ACTIVATION_DTYPES:
            return self.down_proj(cpu_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(activated * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, kernels: LayerKernels, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, layer_index)
        self.mlp = self.build_mlp(config, kernels, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def build_mlp(self, config: ModelConfig, kernels: LayerKernels, layer_index: int) -> nn.Module:
        """The layer's feed-forward part; mixture-of-experts layers build their sparse block here."""
        return MLP(config, kernels)

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
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, kernels: LayerKernels, layer_class: type[DecoderLayer]
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, backend, kernels, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.rotary = RotaryEmbedding(config, kernels)
        # Gemma 3's sliding-window layers rotate at their own base.
        self.local_rotary = RotaryEmbedding(config, kernels, local=True) if config.local_rope_theta else None


class LlamaForCausalLM(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: ModelConfig, backend: AttentionBackend, kernels: LayerKernels = "torch") -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.model = LlamaModel(config, backend, kernels, self.layer_class)
        quantization = current_quantization()
        # A tied output projection where quantization applies to it is a projection of its own, loaded from the
        # embedding's tensor (quantized), and the embedding then reads its rows from it; otherwise it reads the
        # float embedding.
        self.own_output = not config.tie_word_embeddings or (
            quantization is not None and quantization.tied_output_quantized
        )
        if self.own_output:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.group = current_group()

    def long_rope_rows(self, positions: range) -> range:
        """The rotary tables' rows of `positions` for a sequence on LongRoPE's long factors (see RotaryEmbedding)."""
        offset = self.config.max_position_embeddings
        return range(positions.start + offset, positions.stop + offset)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        # [T] each token's position (its rotary row: long_rope_rows on LongRoPE's long factors); [3, T] with M-RoPE
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden] instead of embedding input_ids (image rows spliced in)
    ) -> torch.Tensor:  # [T, hidden]
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.model.rotary(positions, hidden.dtype)
        local_rope = rope if self.model.local_rotary is None else self.model.local_rotary(positions, hidden.dtype)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            layer_rope = rope if layer.self_attn.window is None else local_rope
            hidden, residual = layer(hidden, residual, layer_rope, k_cache, v_cache, metadata)
        return self.model.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, vocab] float32 on the first tensor-parallel rank (the only one when not sharded); None on the others."""
        if self.own_output:
            logits = self.lm_head(hidden)
        elif self._packed_embedding is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, self._packed_embedding, None, "none", [], "")
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        logits = gather_logits(logits, self.config.vocab_size, self.group)
        cap = self.config.final_logit_softcapping
        return logits if logits is None or cap is None else torch.tanh(logits / cap) * cap

    _packed_embedding: torch.Tensor | None = None  # the tied output projection, packed

    def process_weights_after_loading(self, pack_for_cpu: bool) -> None:
        """Each projection's method turns its loaded weights into what its matmul reads (quantizes them, packs
        them); with `pack_for_cpu` (bfloat16 on a CPU with fast bf16) the float layers and a tied output
        projection are prepacked for oneDNN."""
        for module in self.modules():
            if isinstance(module, QuantizableLinear):
                module.process_weights_after_loading(pack_for_cpu)
            elif isinstance(module, Linear) and pack_for_cpu:  # a MoE router
                module.pack_for_cpu()
        if self.config.tie_word_embeddings and self.own_output:
            self.model.embed_tokens.read_rows_from(self.lm_head)
        elif pack_for_cpu and not self.own_output:
            self._packed_embedding = prepack(self.model.embed_tokens.weight)

    # Hugging Face checkpoint name suffix -> (our fused parameter suffix, which part of it)
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def checkpoint_destination(self, name: str) -> tuple[str, CheckpointPart]:
        """Where the Hugging Face checkpoint tensor `name` goes: our parameter's name, and which piece of it the
        tensor is (a part of a fused projection: q, k, v; gate, up), for the sharded layer to place its rank's
        slice of it; None: the whole parameter."""
        module_path, _, leaf = name.rpartition(".")  # leaf: "weight" or "bias"
        parent, _, proj = module_path.rpartition(".")
        if proj not in self._FUSED:
            return name, None
        fused, part = self._FUSED[proj]
        return f"{parent}.{fused}.{leaf}", part

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy Hugging Face-named tensors into this model; every parameter must be covered. A sharded layer
        reads only its rank's slice of each tensor."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}  # parameter -> elements written, so fused and stacked ones count their parts
        for name, tensor in named_tensors:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            target, part = self.checkpoint_destination(name)
            if target not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            if target == "model.embed_tokens.weight" and self.config.tie_word_embeddings and self.own_output:
                # only the quantized output projection holds it: the embedding reads its rows (read_rows_from)
                filled["lm_head.weight"] = self.lm_head.load("weight", tensor, None)
                filled[target] = params[target].numel()
                continue
            module_path, _, leaf = target.rpartition(".")
            module = self.get_submodule(module_path)
            if hasattr(module, "load"):  # a sharded layer: reads its rank's slice only
                written = module.load(leaf, tensor, part)
            else:  # the same on every rank: norms, the MoE router and its shared expert's gate
                whole = read_whole(tensor)
                destination = params[target]
                if destination.shape != whole.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(whole.shape)} != model {tuple(destination.shape)}")
                destination.copy_(whole)
                written = whole.numel()
            filled[target] = filled.get(target, 0) + written
        missing = sorted(name for name, param in params.items() if filled.get(name, 0) < param.numel())
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
