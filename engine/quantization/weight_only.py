"""Weight-only int8 and int4, quantized at load time from any float checkpoint (CPU).

Each output row is cut into groups of `group_size` input features; a group keeps one float32 scale, its largest
magnitude over 127 (int8) or 7 (int4), and its values divided by the scale, rounded to the nearest integer and
clamped to [-128, 127] / [-8, 7]: symmetric, no zero point. Stored as blocks like GGUF's, one per group: the
scale's 4 bytes, then the group's int8 values, or for int4 `group_size / 2` bytes whose low nibbles hold the first
half of the group and high nibbles the second (value + 8). conveyor_kernels/quantized_matmul multiplies them dequantizing on
the fly (value * scale, in float32). Activations stay in the model's dtype (W8A16 / W4A16), or with
quantized_activations "int8" are quantized per token (W8A8 / W4A8: the groups repacked at load by `pack_int8`,
integer dot products). Error: a weight moves by at most half a step, scale / 2; measured on SmolLM2-135M in
README.md. The float weights are loaded first and quantized once all are in, so loading peaks at the unquantized
model's memory."""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization.config import QuantizedActivations
from engine.quantization.unquantized import UnquantizedLinearMethod
from conveyor_kernels import quantized_matmul


_LARGEST = {8: 127, 4: 7}


def quantize_rows(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """uint8 [rows, groups * (4 + payload)] blocks of a float [rows, columns] weight."""
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, columns // group_size, group_size)
    scale = groups.abs().amax(dim=-1, keepdim=True) / _LARGEST[bits]
    values = torch.round(groups / scale.clamp_min(torch.finfo(torch.float32).tiny))
    values = values.clamp(-_LARGEST[bits] - 1, _LARGEST[bits]).to(torch.int8)
    if bits == 8:
        payload = values.view(torch.uint8)
    else:
        unsigned = (values + 8).to(torch.uint8)
        half = group_size // 2
        payload = unsigned[..., :half] | (unsigned[..., half:] << 4)
    return torch.cat([scale.view(torch.uint8), payload], dim=-1).reshape(rows, -1).contiguous()


def dequantize_rows_reference(blocks: torch.Tensor, bits: int, group_size: int, columns: int) -> torch.Tensor:
    """The float32 values of `quantize_rows`' blocks, by the formula the kernel follows: scale * value."""
    rows = blocks.shape[0]
    groups = blocks.reshape(rows, columns // group_size, -1)
    scale = groups[..., :4].contiguous().view(torch.float32)
    payload = groups[..., 4:]
    if bits == 8:
        values = payload.contiguous().view(torch.int8).float()
    else:
        values = torch.cat([payload & 0x0F, payload >> 4], dim=-1).float() - 8
    return (scale * values).reshape(rows, columns)


class WeightOnlyLinearMethod(UnquantizedLinearMethod):
    """Loads float weights as the unquantized method does, then quantizes them."""

    def __init__(self, bits: int, group_size: int, activations: QuantizedActivations | None = None) -> None:
        self.bits = bits
        self.group_size = group_size
        self.activations = activations
        self.format_id = quantized_matmul.INT8 if bits == 8 else quantized_matmul.INT4

    def create_weights(self, layer: nn.Module) -> None:
        if layer.in_features % self.group_size:
            raise ValueError(
                f"int{self.bits} quantization_group_size {self.group_size} does not divide a projection's "
                f"{layer.in_features} input features; pick a group size that divides it"
            )
        super().create_weights(layer)

    def process_weights_after_loading(self, layer: nn.Module, pack_for_cpu: bool) -> None:
        quantized_matmul.load_quantized_kernels()  # a failed build fails the load, not the first step
        layer.qweight = quantize_rows(layer.weight.detach(), self.bits, self.group_size)
        if self.activations == "int8":  # repacked for matmul_int8: the same values, the groups are not kept
            layer.qweight = quantized_matmul.pack_int8(
                layer.qweight, self.format_id, self.group_size, layer.in_features
            )
        del layer.weight

    def dequantize_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` [n] of the quantized matrix (a tied embedding's lookups): scale * value."""
        return quantized_matmul.dequantize_rows(layer.qweight, ids, self.format_id, self.group_size, layer.in_features)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = quantized_matmul.linear(x, layer.qweight, self.format_id, self.group_size, layer.in_features)
        return y if layer.bias is None else y + layer.bias
