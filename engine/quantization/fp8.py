"""FP8 checkpoints (quant_method "fp8", and "compressed-tensors" float8 schemes): each projection's weight is
float8_e4m3fn [out, in] with a float32 `weight_scale`, one per matrix (per-tensor) or per output row
(per-channel); the weight is w8.float() * scale. Activations are either quantized at run time, per token, to
float8 with the scale amax / 448 (dynamic, W8A8), or left as they are (weight-only, W8A16).

Scales are kept per output row whatever the checkpoint has (a per-tensor scale repeated over its rows), so that a
fused q/k/v or gate/up projection, whose parts each have their own per-tensor scale, is one matrix with one row
of scales, and a column-parallel shard takes its rows' scales.

- CUDA (Hopper and newer): W8A8 by `torch._scaled_mm`, the activations quantized per token in torch and both scales
  applied row-wise (per token, per output feature) to the float32 accumulator.
- Elsewhere (the CPU): the weights stay float8 in memory (a byte a weight) and each matmul dequantizes its matrix
  on the fly (w8.float() * scale, cast to the model's dtype; a transient copy), then torch's matmul; with dynamic
  activations the tokens are quantized and dequantized per token first, so the numbers are the W8A8 model's.
A projection the checkpoint left in float (the output projection, `ignore`d) keeps its float weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import CheckpointTensor, read_whole

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 float8_e4m3fn, scale float32 [..., 1]) with x ~ x8.float() * scale: each token's largest magnitude maps
    to 448."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@dataclass(frozen=True)
class Fp8CheckpointTensor:
    """One projection's float8 weight and its scale, standing for the float [out, in] weight: indexed, it
    dequantizes; `piece` gives a projection its slice (float8 rows and their float32 scales)."""

    name: str
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out] (a per-tensor scale repeated)

    def get_shape(self) -> list[int]:
        return list(self.weight.shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        return dequantize(self.weight, self.scale)[index]

    def piece(self, index: tuple[slice, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight[index].contiguous(), self.scale[index[0]].contiguous()


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference dequantization: w8.float() * scale (per output row), float32."""
    return weight.float() * scale.float().unsqueeze(-1)


def _is_fp8(tensor: CheckpointTensor) -> bool:
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype == FP8
    return tensor.get_dtype() == "F8_E4M3"  # type: ignore[attr-defined]  # a safetensors slice


def wrap_checkpoint(named_tensors: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors with each float8 `<module>.weight` and its `<module>.weight_scale` gathered into
    one `Fp8CheckpointTensor`; the others as they are. A module's weight is read whole (a byte a weight) until its
    scale arrives. Static activation scales (`input_scale`) are refused: only dynamic ones are supported."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}

    def complete(module: str) -> tuple[str, Fp8CheckpointTensor]:
        weight, scale = weights.pop(module), scales.pop(module).float().flatten()
        rows = weight.shape[0]
        if scale.numel() == 1:
            scale = scale.expand(rows).contiguous()
        elif scale.numel() != rows:
            raise ValueError(
                f"{module}.weight_scale has {scale.numel()} values; supported: one per tensor or one per output row "
                f"({rows})"
            )
        return f"{module}.weight", Fp8CheckpointTensor(module, weight, scale)

    for name, tensor in named_tensors:
        module, _, leaf = name.rpartition(".")
        if leaf == "input_scale":
            raise ValueError(
                f"{name}: static fp8 activation scales are not supported; supported: dynamic per-token activation "
                f"scales (no input_scale tensors)"
            )
        if leaf == "weight_scale":
            scales[module] = read_whole(tensor)
        elif leaf == "weight" and _is_fp8(tensor):
            weights[module] = read_whole(tensor)
        else:
            yield name, tensor
            continue
        if module in weights and module in scales:
            yield complete(module)
    if weights or scales:
        lacking = sorted(set(weights) ^ set(scales))
        raise ValueError(f"fp8 checkpoint: weight without weight_scale or the reverse for {lacking[:3]}")


class Fp8LinearMethod:
    def __init__(self, dynamic_activations: bool) -> None:
        self.dynamic_activations = dynamic_activations

    def create_weights(self, layer: nn.Module) -> None:
        # A placeholder with the matrix's shape and no memory, for loading's completeness check.
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, device="meta"), requires_grad=False)
        layer.dtype = torch.get_default_dtype()
        layer.device = torch.empty(0).device  # where the model is being built
        layer.fp8_loaded = {}  # first output row -> (float8 rows, scales) or a float tensor

    def load_weight(
        self, layer: nn.Module, tensor: CheckpointTensor, index: tuple[slice, ...], rows: slice, part: int
    ) -> int:
        if isinstance(tensor, Fp8CheckpointTensor):
            layer.fp8_loaded[rows.start] = tensor.piece(index)
        else:
            layer.fp8_loaded[rows.start] = tensor[index].to(layer.dtype).contiguous()
        return (rows.stop - rows.start) * layer.in_features

    def process_weights_after_loading(self, layer: nn.Module, pack_for_cpu: bool) -> None:
        pieces = [piece for _, piece in sorted(layer.fp8_loaded.items())]
        del layer.weight, layer.fp8_loaded
        if all(isinstance(piece, torch.Tensor) for piece in pieces):  # kept float by the checkpoint
            layer.dense_weight, layer.fp8_weight = torch.cat(pieces).to(layer.device), None
            return
        if not all(isinstance(piece, tuple) for piece in pieces):
            raise ValueError("a fused projection whose parts are partly float8, partly float is not supported")
        layer.fp8_weight = torch.cat([weight for weight, _ in pieces]).to(layer.device)
        layer.fp8_scale = torch.cat([scale for _, scale in pieces]).to(layer.device)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.fp8_weight is None:
            y = F.linear(x, layer.dense_weight)
        elif x.device.type == "cuda" and self.dynamic_activations:
            y = _scaled_mm_linear(x, layer.fp8_weight, layer.fp8_scale)
        else:
            if self.dynamic_activations:
                x8, x_scale = quantize_per_token(x)
                x = (x8.float() * x_scale).to(x.dtype)
            y = F.linear(x, dequantize(layer.fp8_weight, layer.fp8_scale).to(x.dtype))
        return y if layer.bias is None else y + layer.bias


def _scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 on CUDA: per-token float8 activations times the float8 weight, scaled row-wise (bf16 out, which
    row-wise scaling requires)."""
    tokens = x.reshape(-1, x.shape[-1])
    x8, x_scale = quantize_per_token(tokens)
    y = torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
