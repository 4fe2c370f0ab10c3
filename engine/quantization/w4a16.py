"""AWQ and GPTQ 4-bit checkpoints (transformers' `quantization_config` quant_method "awq" / "gptq"), kept 4-bit.

Both store, per projection, 4-bit values q, a 4-bit zero point z and a float16 scale s per group of `group_size`
input features of each output feature; the weight is (q - z) * s. They differ in how the nibbles are packed:

- AWQ (AutoAWQ's GEMM version): `qweight` int32 [in, out / 8], eight output features per int32, nibble i holding
  feature `_AWQ_ORDER[i]` of its eight ([0, 2, 4, 6, 1, 3, 5, 7]); `qzeros` int32 [in / group, out / 8] alike;
  `scales` [in / group, out].
- GPTQ (auto-gptq / transformers' "gptq" format v1, or "gptq_v2"): `qweight` int32 [in / 8, out], eight input
  features per int32 in order (nibble j: feature 8i + j); `qzeros` int32 [groups, out / 8], eight output
  features in order, each the zero point minus one in v1; `scales` [groups, out]; `g_idx` [in], each input
  feature's group. With act-order (desc_act) g_idx is a permutation of the groups: the input features are
  reordered so that each group is contiguous, and the activations are reordered alike (x[:, perm]).

`Int4CheckpointTensor` gathers a projection's tensors as loading reads them (the loader groups them by module,
`wrap_checkpoint`); a projection takes this rank's piece unpacked to bytes, and `process_weights_after_loading`
repacks it for its device: on the CPU conveyor_kernels/quantized_matmul's UINT4_ZP groups (float32 scale, uint8 zero
point, 4-bit values: half a byte a weight plus 5 bytes a group), dequantized on the fly to exactly (q - z) * s in
float32; on CUDA the layout of conveyor_kernels/w4a16_matmul's Triton GEMM. No float copy of a weight is kept. Anything
else the checkpoint quantized (an embedding: never in AWQ / GPTQ) would read dequantized.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import CheckpointTensor, read_whole
from engine.quantization.config import QuantizedActivations
from conveyor_kernels import quantized_matmul, w4a16_matmul

Layout = Literal["awq", "gptq"]
SUPPORTED_BITS = (4,)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# AutoAWQ's GEMM pack order: nibble i of an int32 holds output feature _AWQ_ORDER[i] of its eight.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(8, dtype=torch.int32) * 4


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The eight 4-bit values of each int32 of `packed`, low nibble first, as a new axis after `dim` (uint8)."""
    shape = [1] * (packed.dim() + 1)
    shape[dim + 1] = 8
    values = (packed.to(torch.int32).unsqueeze(dim + 1) >> _SHIFTS.view(shape)) & 0xF
    return values.to(torch.uint8)


def _unpack_columns(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """[rows, cols / 8] int32 -> [rows, cols] uint8; nibble i holds column order[i] of its eight (None: i)."""
    values = _nibbles(packed, 1)  # [rows, cols / 8, 8]: by nibble
    if order is not None:
        values = values[:, :, torch.tensor(order).argsort()]  # by column
    return values.reshape(packed.shape[0], -1)


@dataclass(frozen=True)
class Int4Piece:
    """A projection's 4-bit weights, unpacked to one byte a value: q [out, in] (0..15), zeros [out, groups]
    (0..16), scales [out, groups] float32, g_idx [in] int64 (each input feature's group)."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor


def dequantize_piece(piece: Int4Piece) -> torch.Tensor:
    """The reference dequantization, (q - z) * s in float32 ([out, in]): the values the kernels reproduce."""
    zeros = piece.zeros[:, piece.g_idx].float()
    scales = piece.scales[:, piece.g_idx]
    return (piece.q.float() - zeros) * scales


@dataclass(frozen=True)
class Int4CheckpointTensor:
    """One projection's AWQ or GPTQ tensors (packed as the checkpoint has them), standing for the float [out, in]
    weight: indexed, it dequantizes (for a destination that keeps float weights); `piece` gives a projection
    its slice unpacked."""

    layout: Layout
    name: str
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int
    zero_offset: int  # added to the stored zero points: 1 for GPTQ v1, else 0

    def get_shape(self) -> list[int]:
        return [self.scales.shape[1], self.in_features]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * (8 if self.layout == "gptq" else 1)

    def unpacked(self) -> Int4Piece:
        if self.layout == "awq":
            q = _unpack_columns(self.qweight, _AWQ_ORDER).T
            zeros = _unpack_columns(self.qzeros, _AWQ_ORDER).T
        else:
            q = _nibbles(self.qweight, 0).reshape(self.in_features, -1).T  # [in / 8, 8, out] -> [in, out]
            zeros = _unpack_columns(self.qzeros, None).T
        out_features = self.scales.shape[1]
        zeros = zeros[:out_features] + self.zero_offset  # a GPTQ v1 zero point of 0 was stored as 15: 16 here
        if self.g_idx is not None:
            g_idx = self.g_idx.long()
        else:
            g_idx = torch.arange(self.in_features) // self.group_size
        groups = self.scales.shape[0]
        if q.shape != (out_features, self.in_features) or g_idx.shape != (self.in_features,) or (
            g_idx.numel() and int(g_idx.max()) >= groups
        ):
            raise ValueError(f"{self.name}: {self.layout} tensors of inconsistent shapes")
        return Int4Piece(q.contiguous(), zeros.contiguous(), self.scales.T.float().contiguous(), g_idx)

    def __getitem__(self, index: object) -> torch.Tensor:
        return dequantize_piece(self.unpacked())[index]

    def piece(self, index: tuple[slice, ...]) -> Int4Piece:
        """Rows index[0] and, where given, input features index[1] (a row-parallel shard: whole groups, and not
        of an act-order checkpoint, whose groups are scattered over the input features)."""
        whole = self.unpacked()
        rows = index[0]
        q, zeros, scales, g_idx = whole.q[rows], whole.zeros[rows], whole.scales[rows], whole.g_idx
        start, stop = (index[1].start or 0, index[1].stop) if len(index) > 1 else (0, None)
        if (start, stop) not in ((0, None), (0, self.in_features)):
            if not torch.equal(g_idx, torch.arange(self.in_features) // self.group_size):
                raise ValueError(
                    f"{self.name}: a GPTQ act-order (desc_act) checkpoint cannot split a row-parallel projection's "
                    f"input features over tensor-parallel ranks (its groups are scattered over them); run it with "
                    f"tensor_parallel_size=1 or use a checkpoint quantized without desc_act"
                )
            if start % self.group_size or stop % self.group_size:
                raise ValueError(
                    f"{self.name}: a tensor-parallel shard of input features [{start}, {stop}) does not fall on "
                    f"the checkpoint's groups of {self.group_size}; pick a tensor_parallel_size whose shards do"
                )
            groups = slice(start // self.group_size, stop // self.group_size)
            q, zeros, scales = q[:, start:stop], zeros[:, groups], scales[:, groups]
            g_idx = g_idx[start:stop] - start // self.group_size
        return Int4Piece(q.contiguous(), zeros.contiguous(), scales.contiguous(), g_idx)


_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def wrap_checkpoint(
    named_tensors: Iterable[tuple[str, CheckpointTensor]], layout: Layout, group_size: int, zero_offset: int
) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors with each module's qweight / qzeros / scales (/ g_idx) gathered into one
    `Int4CheckpointTensor` named `<module>.weight`; the others as they are. The packed tensors are read whole
    (a quarter of the float weight's bytes) since a module's parts arrive one by one."""
    gathered: dict[str, dict[str, torch.Tensor]] = {}
    required = {"qweight", "qzeros", "scales"}

    def complete(module: str) -> Int4CheckpointTensor:
        parts = gathered.pop(module)
        return Int4CheckpointTensor(
            layout, module, parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), group_size,
            zero_offset,
        )

    for name, tensor in named_tensors:
        module, _, leaf = name.rpartition(".")
        if leaf not in _PARTS:
            yield name, tensor
            continue
        parts = gathered.setdefault(module, {})
        parts[leaf] = read_whole(tensor)
        if required <= parts.keys() and (layout == "awq" or "g_idx" in parts):
            yield f"{module}.weight", complete(module)
    for module in list(gathered):  # GPTQ checkpoints without g_idx (no act-order)
        if not required <= gathered[module].keys():
            missing = sorted(required - gathered[module].keys())
            raise ValueError(f"{layout} checkpoint: module {module!r} lacks {', '.join(missing)}")
        yield f"{module}.weight", complete(module)


def pack_uint4_zp(piece: Int4Piece, group_size: int) -> torch.Tensor:
    """conveyor_kernels/quantized_matmul's UINT4_ZP blocks [out, groups * (5 + group / 2)] of a piece whose groups are
    contiguous (g_idx = k // group_size)."""
    out_features, in_features = piece.q.shape
    groups = in_features // group_size
    q = piece.q.reshape(out_features, groups, group_size)
    half = group_size // 2
    payload = q[..., :half] | (q[..., half:] << 4)
    scales = piece.scales.float().contiguous().view(torch.uint8).reshape(out_features, groups, 4)
    zeros = piece.zeros.to(torch.uint8).reshape(out_features, groups, 1)
    return torch.cat([scales, zeros, payload], dim=-1).reshape(out_features, -1).contiguous()


def _contiguous_groups(piece: Int4Piece, group_size: int, name: str) -> tuple[Int4Piece, torch.Tensor | None]:
    """The piece with its input features reordered so that each group's are contiguous, and the order (None when
    they already are); act-order checkpoints put exactly `group_size` features in each group."""
    in_features = piece.q.shape[1]
    natural = torch.arange(in_features) // group_size
    if torch.equal(piece.g_idx, natural):
        return piece, None
    perm = torch.argsort(piece.g_idx, stable=True)
    if not torch.equal(piece.g_idx[perm], natural):
        raise ValueError(f"{name}: g_idx does not put {group_size} input features in each group; not supported")
    return Int4Piece(piece.q[:, perm].contiguous(), piece.zeros, piece.scales, natural), perm


class W4A16LinearMethod:
    """AWQ / GPTQ 4-bit weights with 16-bit (or float32) activations, or on the CPU int8 ones where asked: the CPU
    kernel of conveyor_kernels/quantized_matmul (UINT4_ZP groups), the Triton GEMM of conveyor_kernels/w4a16_matmul on CUDA. A
    projection the checkpoint left in float (the output projection) keeps its float weight."""

    def __init__(self, group_size: int, activations: QuantizedActivations | None = None) -> None:
        self.group_size = group_size
        self.activations = activations  # "int8": repacked for the CPU's matmul_int8 (CUDA refuses it at load)

    def create_weights(self, layer: nn.Module) -> None:
        # A placeholder with the matrix's shape and no memory, for loading's completeness check; the pieces
        # loaded replace it.
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, device="meta"), requires_grad=False)
        layer.dtype = torch.get_default_dtype()
        layer.device = torch.empty(0).device  # where the model is being built (the placeholder is on "meta")
        layer.w4_loaded = {}  # first output row -> Int4Piece, or a float tensor

    def load_weight(
        self, layer: nn.Module, tensor: CheckpointTensor, index: tuple[slice, ...], rows: slice, part: int
    ) -> int:
        if isinstance(tensor, Int4CheckpointTensor):
            if tensor.group_size != self.group_size:
                raise ValueError(f"{tensor.name}: group size {tensor.group_size} != the config's {self.group_size}")
            layer.w4_loaded[rows.start] = tensor.piece(index)
        else:
            layer.w4_loaded[rows.start] = tensor[index].to(layer.dtype).contiguous()
        return (rows.stop - rows.start) * layer.in_features

    def process_weights_after_loading(self, layer: nn.Module, pack_for_cpu: bool) -> None:
        pieces = [piece for _, piece in sorted(layer.w4_loaded.items())]
        device = layer.device
        del layer.weight, layer.w4_loaded
        if all(isinstance(piece, torch.Tensor) for piece in pieces):  # a projection the checkpoint kept float
            layer.dense_weight = torch.cat(pieces).to(device)
            layer.w4_format = None
            return
        if not all(isinstance(piece, Int4Piece) for piece in pieces):
            raise ValueError("a fused projection whose parts are partly 4-bit, partly float is not supported")
        g_idx = pieces[0].g_idx
        if any(not torch.equal(piece.g_idx, g_idx) for piece in pieces):
            raise ValueError("the parts of a fused projection (q/k/v, gate/up) have different act-order g_idx")
        whole = Int4Piece(
            torch.cat([p.q for p in pieces]), torch.cat([p.zeros for p in pieces]),
            torch.cat([p.scales for p in pieces]), g_idx,
        )
        whole, perm = _contiguous_groups(whole, self.group_size, type(layer).__name__)
        layer.w4_perm = None if perm is None else perm.to(device)
        if device.type == "cuda":
            layer.w4_format = "triton"
            packed = w4a16_matmul.pack(whole.q, whole.zeros, whole.scales)
            layer.w4_qweight, layer.w4_zeros, layer.w4_scales = (t.to(device) for t in packed)
        else:
            quantized_matmul.load_quantized_kernels()  # a failed build fails the load, not the first step
            layer.w4_format = "cpu"
            layer.qweight = pack_uint4_zp(whole, self.group_size)
            if self.activations == "int8":  # repacked for matmul_int8: the same values, the groups are not kept
                layer.qweight = quantized_matmul.pack_int8(
                    layer.qweight, quantized_matmul.UINT4_ZP, self.group_size, layer.in_features
                )

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.w4_format is None:
            y = F.linear(x, layer.dense_weight)
        else:
            if layer.w4_perm is not None:
                x = x[..., layer.w4_perm]
            if layer.w4_format == "cpu":
                y = quantized_matmul.linear(x, layer.qweight, quantized_matmul.UINT4_ZP, self.group_size, layer.in_features)
            else:
                y = w4a16_matmul.linear(x, layer.w4_qweight, layer.w4_zeros, layer.w4_scales, self.group_size)
        return y if layer.bias is None else y + layer.bias
