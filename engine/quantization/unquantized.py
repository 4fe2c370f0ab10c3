"""The unquantized method: the checkpoint's float weights in the model's dtype, torch's matmul; for bfloat16 on a
CPU with fast bf16, a second copy prepacked into oneDNN's blocked layout (measured 1.5x on decode-size matmuls,
where reading the weights is the cost: 26 -> 17 ms for the 30 layers of SmolLM2 at 64 tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import CheckpointTensor

# A batch-size hint for oneDNN's weight layout; packed weights serve any number of tokens.
PACK_FOR_TOKENS = 64


def prepack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_TOKENS)


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, packed_weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    if packed_weight is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class UnquantizedLinearMethod:
    def create_weights(self, layer: nn.Module) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))
        layer.packed_weight = None

    def load_weight(
        self, layer: nn.Module, tensor: CheckpointTensor, index: tuple[slice, ...], rows: slice, part: int
    ) -> int:
        destination = layer.weight[rows]
        destination.copy_(tensor[index])
        return destination.numel()

    def process_weights_after_loading(self, layer: nn.Module, pack_for_cpu: bool) -> None:
        if pack_for_cpu:
            layer.packed_weight = prepack(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, layer.weight, layer.packed_weight, layer.bias)
