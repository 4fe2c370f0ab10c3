"""SigLIP's vision transformer (transformers' `SiglipVisionModel` without its pooling head) in plain torch, batched
over images: the vision tower of Gemma 3. What differs from CLIP's: no class token, a biased patch embedding, no
norm before the layers, a norm after them (`post_layernorm`); the layers are CLIP's (engine/models/clip.py).
Parameter names are transformers' (under `vision_model.`), so checkpoints load as they are."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.models.clip import ClipEncoder, ClipVisionConfig

# SiglipVisionConfig's defaults, for configs saved with only what differs from them (the Hub's Gemma 3 configs)
_DEFAULTS = {"hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "num_channels": 3, "hidden_size": 768,
             "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 224,
             "patch_size": 16}


def siglip_vision_config(hf: dict[str, Any]) -> ClipVisionConfig:
    """The tower's shape from a `siglip_vision_model` config (the same fields as CLIP's)."""
    if hf.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(f"unsupported vision tower {hf.get('model_type')!r}; supported: siglip_vision_model")
    merged = {**_DEFAULTS, **hf}
    return ClipVisionConfig(**{name: merged[name] for name in ClipVisionConfig.__dataclass_fields__})


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] -> [N, patches, hidden]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    """transformers' `SiglipVisionTransformer` (its `vision_model`) less the pooling head (Gemma 3 has none):
    `forward` returns its `last_hidden_state`, [N, patches, hidden]."""

    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = ClipEncoder(config, config.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)
