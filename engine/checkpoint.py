"""A checkpoint tensor as loading sees it: read only where indexed (a safetensors slice, a GGUF tensor of blocks),
or a torch.Tensor."""

from __future__ import annotations

from typing import Protocol

import torch


class CheckpointTensor(Protocol):
    """A tensor of a checkpoint that is read only where indexed: a safetensors slice, a GGUF tensor of blocks
    (engine/quantization/gguf.py), or a torch.Tensor."""

    def __getitem__(self, index: object) -> torch.Tensor: ...


def full_shape(tensor: CheckpointTensor) -> tuple[int, ...]:
    if isinstance(tensor, torch.Tensor):
        return tuple(tensor.shape)
    return tuple(tensor.get_shape())  # type: ignore[attr-defined]


def read_whole(tensor: CheckpointTensor) -> torch.Tensor:
    if isinstance(tensor, torch.Tensor):
        return tensor
    return tensor[:] if full_shape(tensor) else tensor[()]  # a scalar (an FP8 per-tensor scale) takes no slice
