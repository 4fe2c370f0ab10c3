"""Matmuls of quantized weights on the CPU (`quantized_matmul.cpp`), dequantizing on the fly, and their torch
reference.

A weight is a uint8 [rows, row_bytes] tensor of blocks, each row the blocks of one output feature: GGUF's
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K exactly as llama.cpp stores them, or the weight-only groups of
engine/quantization/weight_only.py (INT8, INT4: a float32 scale then the group's values), or the 4-bit groups with
a zero point of AWQ / GPTQ checkpoints (UINT4_ZP, repacked by engine/quantization/w4a16.py). `matmul` dequantizes
16 rows at a time into float32 and multiplies them by every token while they sit in cache (4 tokens x 4 rows of
register accumulators), so a decode step reads the weight's bytes once, a quarter to a half of bf16's.
Dequantization gives bit for bit gguf-py's float32 values (see quantized_matmul_body.h); the products are float32
sums in another order than torch's matmul.

The float32 body is compiled for AVX-512, for AVX2 + FMA and portably (`quantized_matmul_avx512.cpp`, `_avx2.cpp`,
`_portable.cpp`; the bf16 path `quantized_matmul_avx512_bf16.cpp`: ninja builds them in parallel beside the
module's `quantized_matmul.cpp`), and `isa="auto"` takes the widest the CPU runs; tests force each path by name.
bf16 x has one more path, `avx512_bf16` (`quantized_matmul_bf16.h`), which `auto` takes where the CPU has AVX-512 BF16: the 16 dequantized rows are rounded to bf16 as torch rounds (so it
multiplies exactly `dequantize(w).to(torch.bfloat16)`, the weights `linear`'s large steps use) and multiplied with
bf16 dot products (vdpbf16ps: 32 products an instruction against the float32 FMAs' 16), float32 sums. On a CPU
without AVX-512 BF16, bf16 x is converted to float32 and meets the float32 weights on the float32 paths. float32 x
always takes the float32 paths. The reference: dequantize (gguf-py's `gguf.quants.dequantize` for GGUF blocks, the
weight-only formula for groups) in float32, then torch's matmul (of the bf16-rounded weights for the bf16 path).

int8 activations (`pack_int8` once at load, then `matmul_int8`; quantized_matmul_int8.h): each step's x is quantized
per token in blocks of 32 to int8 and multiplied by the weights' own integer quants with integer dot products
(AVX-512 VNNI's vpdpbusd where the CPU has it, `quantized_matmul_avx512_vnni.cpp`; else AVX2's vpmaddubsw, in
`quantized_matmul_avx2.cpp`; else a plain C++ dot product, `_portable.cpp`), as llama.cpp multiplies its blocks. Not exact: its oracle is the float64 product of the quantized x
and the dequantized weights (`matmul_int8_reference`), which it equals to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Literal

import numpy as np
import torch

from conveyor_kernels.cpu_kernels import build_digest, load_extension

# The module, then the body's build per instruction set and the bf16 path (quantized_matmul.h), which ninja compiles
# in parallel.
_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "quantized_matmul.cpp", "quantized_matmul_avx512.cpp", "quantized_matmul_avx2.cpp",
        "quantized_matmul_portable.cpp", "quantized_matmul_avx512_bf16.cpp", "quantized_matmul_avx512_vnni.cpp",
        "quantized_matmul_amx.cpp",
    )
]

# avx512_bf16: bf16 x only (matmul); amx_int8 and avx512_vnni: matmul_int8 only, whose paths are auto, amx_int8,
# avx512_vnni, avx2, portable
Isa = Literal["auto", "avx512_bf16", "amx_int8", "avx512_vnni", "avx512", "avx2", "portable"]

# Weight formats by name: (format id the C++ kernels know, values per block, bytes per block); for INT8 and INT4
# the values per block are the group size, given with each call.
GGUF_FORMATS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}
INT8, INT4 = 1008, 1004
# AWQ / GPTQ 4-bit groups repacked at load (engine/quantization/w4a16.py): float32 scale, uint8 zero point, nibbles.
UINT4_ZP = 1005


@cache
def load_quantized_kernels() -> ModuleType:
    """The compiled extension. Unlike the optional CPU kernels there is no torch path to keep: a quantized model
    needs it, so a failed build raises (with the compiler's message)."""
    return load_extension(
        f"conveyor_quantized_matmul_{build_digest(*_SOURCES)}",
        "the quantized matmul kernels",
        _SOURCES,
        extra_cflags=["-O3", "-fopenmp"],  # no -march=native: each path is compiled for its own instruction set
        extra_ldflags=["-fopenmp"],  # at::parallel_for runs its threads through OpenMP: without it, one thread
    )


def best_isa() -> str:
    """The path `isa="auto"` runs on this CPU for float32 x: avx512, avx2 or portable."""
    return load_quantized_kernels().best_isa()


def has_avx512_bf16() -> bool:
    """Whether this CPU runs the avx512_bf16 path (AVX-512 BF16), which `isa="auto"` takes for bf16 x."""
    return load_quantized_kernels().has_avx512_bf16()


def auto_path(dtype: torch.dtype) -> str:
    """The path `isa="auto"` runs on this CPU for x of `dtype` (as `linear` passes it: bf16, else float32)."""
    return "avx512_bf16" if dtype == torch.bfloat16 and has_avx512_bf16() else best_isa()


def format_id(name: str) -> int:
    return GGUF_FORMATS[name][0]


def dequantize(weight: torch.Tensor, format_id: int, group: int, columns: int, isa: Isa = "auto") -> torch.Tensor:
    """float32 [rows, columns] values of uint8 [rows, row_bytes] blocks (`group`: INT8 / INT4 / UINT4_ZP only, else 0)."""
    return load_quantized_kernels().dequantize(weight, format_id, group, columns, isa)


def matmul(x: torch.Tensor, weight: torch.Tensor, format_id: int, group: int, isa: Isa = "auto") -> torch.Tensor:
    """x [tokens, columns] float32 or bf16 @ dequantize(weight).T -> [tokens, rows] float32. On the avx512_bf16
    path (bf16 x) the weights are `dequantize(weight).to(torch.bfloat16)`; on the others x is taken to float32 and
    the weights are float32."""
    return load_quantized_kernels().matmul(x, weight, format_id, group, isa)


# int8 activations (`matmul_int8`, llama.cpp's way): each token's values are quantized in blocks of this many input
# features, one float32 scale a block.
ACTIVATION_BLOCK = 32


@dataclass(frozen=True)
class Int8Weight:
    """A quantized weight repacked once for `matmul_int8` (quantized_matmul_int8.h's layout): per tile of 16 rows its
    unsigned quants u in the order the dot products read them (a byte each, two for the 4-bit formats), and per
    sub-block of 32 values (Q6_K: 16) the rows' float32 scales d and, for formats with a min or a zero point per group,
    offsets m: the values d * (u - the format's zero point) + m are the blocks' exactly."""

    quants: torch.Tensor  # uint8 [tiles, tile bytes]
    scales: torch.Tensor  # float32 [tiles, sub-blocks, 16]
    mins: torch.Tensor  # float32 [tiles, sub-blocks, 16], or [0] (Q4_0, Q5_0, Q6_K, Q8_0, int8, int4)
    format_id: int
    group: int
    rows: int
    columns: int

    @property
    def nbytes(self) -> int:
        return self.quants.nbytes + self.scales.nbytes + self.mins.nbytes

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), columns]: rows `ids` (int64 [n]) dequantized, the values the blocks hold exactly (a tied
        embedding's lookups in its output projection's repack)."""
        return load_quantized_kernels().int8_rows(self.quants, self.scales, self.mins, self.format_id, self.group,
                                                  self.columns, ids)


def pack_int8(weight: torch.Tensor, format_id: int, group: int, columns: int) -> Int8Weight:
    """uint8 [rows, row_bytes] blocks repacked for `matmul_int8` (every format; groups must be multiples of 32)."""
    quants, scales, mins = load_quantized_kernels().pack_int8(weight, format_id, group, columns)
    return Int8Weight(quants, scales, mins, format_id, group, weight.shape[0], columns)


def matmul_int8(x: torch.Tensor, weight: Int8Weight, isa: Isa = "auto") -> torch.Tensor:
    """x [..., columns] float32 or bf16 (any strides), quantized to int8 by `quantize_activations_reference`'s rule,
    @ the dequantized weight.T -> [..., rows] float32, with integer dot products on the weight's quants (see
    quantized_matmul_int8.h). Equals `matmul_int8_reference` up to float32 summation order."""
    return load_quantized_kernels().matmul_int8(x, weight.quants, weight.scales, weight.mins, weight.format_id,
                                                weight.group, weight.rows, isa)


def int8_path() -> str:
    """The path `matmul_int8(isa="auto")` runs on this CPU: amx_int8 (tdpbsud on AMX tiles, where the kernel lends
    them), avx512_vnni (vpdpbusd), avx2 (vpmaddubsw: also on AVX-512 CPUs without VNNI) or portable (plain C++)."""
    return load_quantized_kernels().int8_path()


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, columns] (columns a multiple of ACTIVATION_BLOCK) as int8 quants [tokens, columns] and float32
    scales [tokens, columns / ACTIVATION_BLOCK]: per block, scale = max |x| / 127 and q = round(x / scale), halves to
    even, in float32 (a block of zeros: scale 0, q 0). The kernels compute exactly these."""
    tokens, columns = x.shape
    blocks = x.float().reshape(tokens, columns // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    quants = torch.where(scales[..., None] > 0, torch.round(blocks / safe[..., None]), 0.0).clamp(-127, 127)
    return quants.to(torch.int8).reshape(tokens, columns), scales


def matmul_int8_reference(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    """The oracle of `matmul_int8`: x's int8 quants times their scales, times the dequantized weight, in float64."""
    quants, scales = quantize_activations_reference(x)
    tokens, columns = quants.shape
    values = quants.double().reshape(tokens, -1, ACTIVATION_BLOCK) * scales.double()[..., None]
    return (values.reshape(tokens, columns) @ dequantized.double().T).float()


def gguf_dequantize_reference(weight: torch.Tensor, name: str) -> torch.Tensor:
    """gguf-py's float32 values of GGUF blocks [rows, row_bytes] of type `name`."""
    import gguf

    values = gguf.quants.dequantize(weight.numpy(), gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def matmul_reference(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    """The oracle of `matmul`'s float32 paths: float32 matmul of the dequantized weight."""
    return x.float() @ dequantized.T


def matmul_bf16_reference(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    """The oracle of `matmul`'s avx512_bf16 path: float32 matmul of bf16 x and the dequantized weight rounded to bf16."""
    return x.float() @ dequantized.to(torch.bfloat16).float().T


# Above this many tokens a step dequantizes the weight and runs torch's matmul instead (prefill): the on-the-fly
# kernel wins by reading fewer bytes, which matters while few tokens share each weight read.
DEQUANTIZE_ABOVE_TOKENS = 32


def dequantize_rows(weight: torch.Tensor | Int8Weight, ids: torch.Tensor, format_id: int, group: int,
                    columns: int) -> torch.Tensor:
    """float32 [len(ids), columns]: rows `ids` (int64 [n]) of a weight as `linear` takes it (blocks, or their repack
    by `pack_int8`), dequantized: an embedding's lookups."""
    if isinstance(weight, Int8Weight):
        return weight.dequantize_rows(ids)
    return dequantize(weight.index_select(0, ids), format_id, group, columns)


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight, format_id: int, group: int, columns: int) -> torch.Tensor:
    """x [..., columns] @ dequantize(weight).T in x's dtype, for a layer. A weight packed by `pack_int8` (int8
    activations): every step quantizes x to int8 (`matmul_int8`), whatever its size. Blocks: the on-the-fly kernel
    for decode-size steps, dequantize-then-matmul (torch's, in x's dtype) for large ones. In a bf16 run both
    multiply the weights rounded to bf16 where the CPU has AVX-512 BF16; without it the kernel's steps multiply the
    float32 weights (x converted to float32) and only the large steps the bf16-rounded ones. float32 runs: float32
    weights throughout."""
    if isinstance(weight, Int8Weight):  # four calls a layer each step: no Python op they do not need
        out = matmul_int8(x, weight)
        return out if out.dtype == x.dtype else out.to(x.dtype)
    tokens = x.reshape(-1, columns)
    if tokens.shape[0] > DEQUANTIZE_ABOVE_TOKENS:
        out = torch.nn.functional.linear(tokens, dequantize(weight, format_id, group, columns).to(x.dtype))
    else:
        tokens = tokens if tokens.dtype == torch.bfloat16 else tokens.float()
        out = matmul(tokens.contiguous(), weight, format_id, group).to(x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])
