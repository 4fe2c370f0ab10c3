"""Qwen2.5-VL's vision transformer (transformers' `Qwen2_5_VisionTransformerPretrainedModel`) in plain torch,
batched over images of one grid: a Conv3d patch embedding over (temporal patch, patch, patch), 2-D rotary positions
(a patch's row and column, each over a quarter of the head), RMSNorm blocks with a gated MLP, attention within
windows of `window_size` pixels except in the `fullatt_block_indexes` blocks (the whole image), and the merger
(RMSNorm, then each 2 x 2 block of patches through a two-layer GELU MLP into one text-embedding row). Parameter
names are transformers' (under `visual.`), so checkpoints load as they are.

Patches are ordered as the processor writes them (merge blocks row-major); attention runs in window order
(transformers' `window_index`: windows row-major, the blocks of a window row-major), and the merged rows go back to
block order, one per placeholder token. Windows of one size are attended in one batched call."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.multimodal.kind import load_encoder_weights

# Qwen2_5_VLVisionConfig's defaults (the Hub's configs spell in_channels "in_chans")
_DEFAULTS = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
             "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
             "window_size": 112, "out_hidden_size": 3584, "fullatt_block_indexes": (7, 15, 23, 31)}
_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class Qwen25VisionConfig:
    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int  # pixels per attention window side
    out_hidden_size: int  # the text model's hidden size
    fullatt_block_indexes: tuple[int, ...]  # blocks attending over the whole image
    rope_theta: float

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Qwen25VisionConfig":
        merged = {**_DEFAULTS, **hf}
        if "in_chans" in hf and "in_channels" not in hf:
            merged["in_channels"] = hf["in_chans"]
        if merged["hidden_act"] not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported vision activation {merged['hidden_act']!r}; supported: {sorted(_ACTIVATIONS)}"
            )
        theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
        fields = {name: merged[name] for name in cls.__dataclass_fields__ if name != "rope_theta"}
        fields["fullatt_block_indexes"] = tuple(fields["fullatt_block_indexes"])
        return cls(**fields, rope_theta=float(theta))

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class VisionRMSNorm(nn.Module):
    """transformers' RMSNorm as the vision tower computes it (float32 statistics, weight times the cast-back)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: Qwen25VisionConfig) -> None:
        super().__init__()
        size, width = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(size, width), nn.Linear(size, width)
        self.down_proj = nn.Linear(width, size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@dataclass(frozen=True)
class GridLayout:
    """What a grid's attention needs, computed once per grid: the window order of the patches, the rows of each
    window (grouped by window size) and of the whole image, and each patch's (row, column) in window order."""

    window_order: torch.Tensor  # [patches] patch indices (processor order) in window order
    window_groups: tuple[torch.Tensor, ...]  # per window size: [windows, size] rows in window order
    merged_order: torch.Tensor  # [blocks] where each merged row (window order) goes back to (block order)
    patch_positions: torch.Tensor  # [patches, 2] (row, column) of each patch, in window order


@lru_cache(maxsize=64)
def grid_layout(frames: int, rows: int, columns: int, merge: int, window_blocks: int) -> GridLayout:
    """transformers' `get_vision_window_index` and `get_vision_position_ids` for one grid: windows of
    `window_blocks` x `window_blocks` merge blocks, the last row and column of windows cut by the grid's edge."""
    block_rows, block_columns = rows // merge, columns // merge
    unit = merge * merge
    blocks = torch.arange(frames * block_rows * block_columns).reshape(frames, block_rows, block_columns)
    order: list[torch.Tensor] = []
    sizes: list[int] = []
    for frame in range(frames):
        for top in range(0, block_rows, window_blocks):
            for left in range(0, block_columns, window_blocks):
                window = blocks[frame, top : top + window_blocks, left : left + window_blocks].reshape(-1)
                order.append(window)
                sizes.append(window.numel() * unit)
    block_order = torch.cat(order)
    window_order = (block_order[:, None] * unit + torch.arange(unit)).reshape(-1)
    groups: dict[int, list[torch.Tensor]] = {}
    start = 0
    for size in sizes:
        groups.setdefault(size, []).append(torch.arange(start, start + size))
        start += size
    # Each patch's (row, column) in processor order (merge blocks row-major, then within the block), for one frame
    row_ids = torch.arange(rows)[:, None].expand(rows, columns)
    column_ids = torch.arange(columns)[None, :].expand(rows, columns)
    in_blocks = [ids.reshape(block_rows, merge, block_columns, merge).transpose(1, 2).reshape(-1)
                 for ids in (row_ids, column_ids)]
    positions = torch.stack(in_blocks, dim=-1).repeat(frames, 1)
    return GridLayout(
        window_order=window_order,
        window_groups=tuple(torch.stack(group) for group in groups.values()),
        merged_order=torch.argsort(block_order),
        patch_positions=positions[window_order],
    )


class VisionAttention(nn.Module):
    def __init__(self, config: Qwen25VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """x [N, patches, hidden] in window order; each of `groups` [segments, length] holds the rows that attend
        to one another (a window each, or the whole image)."""
        batch, length, size = x.shape
        q, k, v = self.qkv(x).reshape(batch, length, 3, self.num_heads, self.head_dim).unbind(2)
        # Rotated in float32, as transformers does, then back to the activations' dtype
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.empty_like(q)
        heads, head_dim = self.num_heads, self.head_dim
        for rows in groups:
            segments, segment_length = rows.shape
            flat = rows.reshape(-1)
            q_rows, k_rows, v_rows = (
                t[:, flat].reshape(batch * segments, segment_length, heads, head_dim).transpose(1, 2) for t in (q, k, v)
            )
            attended = F.scaled_dot_product_attention(q_rows, k_rows, v_rows, scale=head_dim**-0.5)
            out[:, flat] = attended.transpose(1, 2).reshape(batch, segments * segment_length, heads, head_dim)
        return self.proj(out.reshape(batch, length, size))


class VisionBlock(nn.Module):
    def __init__(self, config: Qwen25VisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size)
        self.norm2 = VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: Qwen25VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=False)
        self.config = config

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [P, patch_dim] -> [P, hidden]
        config = self.config
        cubes = patches.view(-1, config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        return self.proj(cubes.to(self.proj.weight.dtype)).view(-1, config.hidden_size)


class PatchMerger(nn.Module):
    def __init__(self, config: Qwen25VisionConfig) -> None:
        super().__init__()
        width = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, config.out_hidden_size))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, patches, hidden] -> [N, patches / merge², out]
        return self.mlp(self.ln_q(x).reshape(x.shape[0], -1, self.width))


class Qwen25VisionTransformer(nn.Module):
    """transformers' vision tower and merger; `forward` takes images of one grid and gives one text-embedding row
    per placeholder token, in the prompt's order."""

    def __init__(self, config: Qwen25VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        half = config.hidden_size // config.num_heads // 2  # row and column turn a quarter of the head each
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, frames, rows, columns, patch values] (the processor's rows of each image, shaped by its grid) ->
        [N, frames * rows * columns / merge², out_hidden_size]."""
        config = self.config
        count, frames, rows, columns, _ = pixel_values.shape
        merge = config.spatial_merge_size
        layout = grid_layout(frames, rows, columns, merge, config.window_size // merge // config.patch_size)
        device = pixel_values.device
        hidden = self.patch_embed(pixel_values.reshape(-1, config.patch_dim)).view(count, -1, config.hidden_size)
        hidden = hidden[:, layout.window_order.to(device)]
        freqs = layout.patch_positions.to(device)[..., None].float() * self.inv_freq  # [P, 2, quarter / 2]
        angles = freqs.flatten(1).repeat(1, 2)[:, None, :]  # (row, column) then again: the whole head, per head
        cos, sin = angles.cos(), angles.sin()
        windows = tuple(group.to(device) for group in layout.window_groups)
        whole = (torch.arange(hidden.shape[1], device=device).view(frames, -1),)  # each frame whole
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin, whole if index in config.fullatt_block_indexes else windows)
        return self.merger(hidden)[:, layout.merged_order.to(device)]

    def load_weights(self, named_tensors: Any) -> None:
        load_encoder_weights(self, named_tensors, strict_family="Qwen2.5-VL")  # every vision tensor is read
