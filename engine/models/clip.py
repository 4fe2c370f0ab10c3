"""CLIP's vision transformer (transformers' `CLIPVisionModel`) in plain torch, batched over images: the vision tower
of LLaVA. Parameter names are transformers' (under `vision_model.`), so checkpoints load as they are. Only the
layers up to the deepest hidden state a model reads are built and run (LLaVA reads the last but one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# CLIPVisionConfig's defaults, for configs saved with only what differs from them (the Hub's LLaVA configs)
_DEFAULTS = {"hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "num_channels": 3, "hidden_size": 768,
             "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 224,
             "patch_size": 32}


def activation(name: str) -> Any:
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported vision activation {name!r}; supported: quick_gelu, gelu, gelu_pytorch_tanh")


@dataclass(frozen=True)
class ClipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int  # pixels per side of the (square) input
    patch_size: int  # pixels per side of a patch: (image_size / patch_size)^2 patches plus the class token
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ClipVisionConfig":
        if hf.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"unsupported vision tower {hf.get('model_type')!r}; supported: clip_vision_model")
        merged = {**_DEFAULTS, **hf}
        return cls(**{name: merged[name] for name in cls.__dataclass_fields__})

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ClipEmbeddings(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(config.num_patches + 1, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] -> [N, 1 + patches, hidden]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = size // self.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(size, size) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, size = x.shape
        q, k, v = (proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, size))


class ClipMLP(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ClipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, config: ClipVisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(config) for _ in range(num_layers))


class ClipVisionModel(nn.Module):
    """transformers' `CLIPVisionTransformer` (its `vision_model`) less the final norm and the layers past
    `num_layers`; `forward` returns the hidden states as transformers' `hidden_states` tuple numbers them."""

    def __init__(self, config: ClipVisionConfig, num_layers: int) -> None:
        super().__init__()
        self.config = config
        self.embeddings = ClipEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # (sic: transformers' name)
        self.encoder = ClipEncoder(config, num_layers)

    def forward(self, pixel_values: torch.Tensor, hidden_state_indices: tuple[int, ...]) -> list[torch.Tensor]:
        """Hidden states at `hidden_state_indices` (0: the embeddings after the first norm, i: after layer i), each
        [N, 1 + patches, hidden]."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: hidden}
        for index, layer in enumerate(self.encoder.layers, start=1):
            hidden = layer(hidden)
            states[index] = hidden
        return [states[index] for index in hidden_state_indices]
