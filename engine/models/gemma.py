"""Gemma 2 and Gemma 3 (text) decoders, built from the Llama parts.

What differs from Llama, all driven by `ModelConfig`: embeddings scaled by sqrt(hidden_size) (rounded
to the model's dtype, as transformers does), GeGLU MLP, RMSNorm scaling by (1 + weight) (folded into
the weight at load), a norm after attention and a pair around the MLP, attention scaled by
query_pre_attn_scalar, soft-capped attention scores and logits (Gemma 2), q/k RMSNorm and a separate
RoPE base for the sliding-window layers (Gemma 3), which alternate with global layers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.parallel_layers import CheckpointTensor, read_whole
from engine.models.llama import DecoderLayer, LayerKernels, LlamaForCausalLM, RMSNorm, RopeStep


class GemmaDecoderLayer(DecoderLayer):
    """norm -> attention -> norm, + residual; norm -> MLP -> norm, + residual. The residual adds are
    fused into the norms that follow them, as in the Llama layer."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, kernels: LayerKernels, layer_index: int) -> None:
        super().__init__(config, backend, kernels, layer_index)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

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
        hidden = self.post_attention_layernorm(hidden)[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return self.post_feedforward_layernorm(hidden)[0], residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer

    def __init__(self, config: ModelConfig, backend: AttentionBackend, kernels: LayerKernels = "torch") -> None:
        super().__init__(config, backend, kernels)
        # float32, rounded to the model's dtype with the rest of it, as transformers rounds it
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        return hidden * self.embed_scale.to(hidden.dtype)

    def load_weights(self, named_tensors: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Gemma's RMSNorms scale by (1 + weight): stored here as one weight, in float32 before any
        rounding to the model's dtype."""
        super().load_weights(
            (name, read_whole(tensor).float() + 1.0 if "norm." in name else tensor) for name, tensor in named_tensors
        )
