"""GGUF's quantized tensors kept as the file has them: blocks of 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or 256
(the K-quants Q4_K, Q5_K, Q6_K, a super-block of sub-blocks with 6- or 8-bit sub-scales), each row of a matrix the
blocks of one output feature. The import (engine/gguf_import.py) copies the blocks into the converted folder's
safetensors as uint8 [rows, row_bytes] tensors and names each tensor's type in config.json; `GGUFTensor` carries
one into loading. Projections keep the blocks and multiply them with conveyor_kernels/quantized_matmul, which dequantizes
on the fly to exactly gguf-py's float32 values (in a bf16 run on a CPU with AVX-512 BF16, those rounded to bf16,
the weights of its large steps too), or, with int8 activations, repacked at load (`pack_int8`) and multiplied by
integer dot products with the tokens' int8 quants; every other destination (embeddings, MoE experts) reads the
tensor dequantized, exactly, into its dtype. Fused projections whose parts differ in type (a Q4_K_M file's Q6_K
attn_v beside Q4_K q and k) keep one piece per type, run one after the other."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import CheckpointTensor, full_shape
from engine.quantization.config import QuantizedActivations
from conveyor_kernels import quantized_matmul
from conveyor_kernels.quantized_matmul import GGUF_FORMATS, Int8Weight

# The quantized GGUF types kept as blocks; the float types (F32, F16, BF16) are read as float tensors.
SUPPORTED_TYPES: tuple[str, ...] = tuple(GGUF_FORMATS)
FLOAT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")


def check_supported(type_name: str, tensor_name: str) -> None:
    if type_name not in SUPPORTED_TYPES and type_name not in FLOAT_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor_name!r} has type {type_name}, which this engine does not run; supported: "
            f"{', '.join(SUPPORTED_TYPES + FLOAT_TYPES)}"
        )


@dataclass(frozen=True)
class GGUFTensor:
    """A checkpoint tensor of GGUF blocks: `raw` uint8 [..., rows, row_bytes] (a safetensors slice, read only where
    indexed) of type `type_name`. Indexed like the float tensor it stands for, it dequantizes (what layers keeping
    float weights read); `blocks` gives a piece's bytes as they are."""

    raw: CheckpointTensor
    type_name: str

    def get_shape(self) -> list[int]:
        *outer, row_bytes = full_shape(self.raw)
        _, values, block_bytes = GGUF_FORMATS[self.type_name]
        return [*outer, row_bytes // block_bytes * values]

    def __getitem__(self, index: object) -> torch.Tensor:
        if isinstance(index, slice):  # rows: only those are read and dequantized
            return self._dequantize(self.raw[index])
        return self._dequantize(self.raw[:])[index]

    def _dequantize(self, raw: torch.Tensor) -> torch.Tensor:
        format_id, values, block_bytes = GGUF_FORMATS[self.type_name]
        columns = raw.shape[-1] // block_bytes * values
        flat = raw.reshape(-1, raw.shape[-1]).contiguous()
        return quantized_matmul.dequantize(flat, format_id, 0, columns).reshape(*raw.shape[:-1], columns)

    def blocks(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The bytes of rows index[0] and, where given, columns index[1] (which must fall on block boundaries: a
        tensor-parallel shard of the input features)."""
        rows = index[0]
        if len(index) == 1 or index[1] == slice(None):
            return self.raw[rows]
        _, values, block_bytes = GGUF_FORMATS[self.type_name]
        start, stop = index[1].start or 0, index[1].stop
        if start % values or stop % values:
            raise ValueError(
                f"a {self.type_name} tensor splits only at multiples of {values} input features; this shard is "
                f"[{start}, {stop}): pick a tensor_parallel_size whose shards fall on blocks"
            )
        return self.raw[rows, start // values * block_bytes : stop // values * block_bytes]


@dataclass(frozen=True)
class _Piece:
    """Consecutive output rows of a projection: GGUF blocks (format_id set; with int8 activations repacked by
    `pack_int8`) or a float matrix of the file's."""

    format_id: int | None
    weight: torch.Tensor | Int8Weight


class GGUFLinearMethod:
    def __init__(self, activations: QuantizedActivations | None = None) -> None:
        self.activations = activations  # "int8": blocks repacked for matmul_int8 (float pieces stay F.linear)

    def create_weights(self, layer: nn.Module) -> None:
        # A placeholder with the matrix's shape and no memory, so that loading can be checked for completeness;
        # the pieces loaded replace it.
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, device="meta"), requires_grad=False)
        layer.dtype = torch.get_default_dtype()
        layer.gguf_loaded = {}  # first output row -> (type name or None for float, tensor)

    def load_weight(
        self, layer: nn.Module, tensor: CheckpointTensor, index: tuple[slice, ...], rows: slice, part: int
    ) -> int:
        if isinstance(tensor, GGUFTensor):
            layer.gguf_loaded[rows.start] = (tensor.type_name, tensor.blocks(index).contiguous())
        else:  # a float tensor of the file: kept dense in the model's dtype
            layer.gguf_loaded[rows.start] = (None, tensor[index].to(layer.dtype).contiguous())
        return (rows.stop - rows.start) * layer.in_features

    def process_weights_after_loading(self, layer: nn.Module, pack_for_cpu: bool) -> None:
        quantized_matmul.load_quantized_kernels()  # a failed build fails the load, not the first step
        del layer.weight
        pieces: list[tuple[str | None, torch.Tensor]] = []
        for _, (type_name, weight) in sorted(layer.gguf_loaded.items()):
            if pieces and pieces[-1][0] == type_name:  # neighbours of one type: one matmul
                pieces[-1] = (type_name, torch.cat([pieces[-1][1], weight]))
            else:
                pieces.append((type_name, weight))
        del layer.gguf_loaded
        layer.gguf_pieces = [
            _Piece(None, weight) if type_name is None else self._piece(GGUF_FORMATS[type_name][0], weight, layer)
            for type_name, weight in pieces
        ]

    def _piece(self, format_id: int, blocks: torch.Tensor, layer: nn.Module) -> _Piece:
        if self.activations == "int8":  # the repacked quants hold the same values: the blocks are not kept
            return _Piece(format_id, quantized_matmul.pack_int8(blocks, format_id, 0, layer.in_features))
        return _Piece(format_id, blocks)

    def dequantize_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` [n] of the layer's matrix (one piece of blocks: a tied embedding's lookups)."""
        (piece,) = layer.gguf_pieces
        return quantized_matmul.dequantize_rows(piece.weight, ids, piece.format_id, 0, layer.in_features)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        pieces = layer.gguf_pieces
        if len(pieces) == 1:  # the usual case, four times a layer each step: no list, no concatenation
            y = self._product(pieces[0], x, layer.in_features)
        else:
            y = torch.cat([self._product(piece, x, layer.in_features) for piece in pieces], dim=-1)
        return y if layer.bias is None else y + layer.bias

    @staticmethod
    def _product(piece: _Piece, x: torch.Tensor, columns: int) -> torch.Tensor:
        if piece.format_id is None:
            return F.linear(x, piece.weight)
        return quantized_matmul.linear(x, piece.weight, piece.format_id, 0, columns)
