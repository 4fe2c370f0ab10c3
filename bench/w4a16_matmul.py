"""One projection's matmul at decode sizes on the CPU: AWQ / GPTQ's 4-bit groups with zero points (UINT4_ZP, the
repacked checkpoint's) against the weight-only int4 groups and the float weight, bf16 activations, in one process.

    python -m bench.w4a16_matmul --rows 1536 --columns 576 --tokens 1 16 --group 128

Each timed call multiplies `--layers` different matrices of the shape, one after the other, as a decode step does,
so the weights come from memory rather than a cache that one small matrix fits in; a row is the median call over
`--repeats` after a warm-up, divided by the layers; weight bytes as held, for one matrix.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import markdown_table, ratio, run_cli
from bench.report import describe_machine
from engine.quantization.unquantized import prepack
from engine.quantization.w4a16 import Int4Piece, pack_uint4_zp
from engine.quantization.weight_only import quantize_rows
from conveyor_kernels import quantized_matmul


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1536, help="output features (SmolLM2's gate/up: 1536)")
    parser.add_argument("--columns", type=int, default=576, help="input features (SmolLM2's hidden size: 576)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--group", type=int, default=64, help="input features per group (divides --columns)")
    parser.add_argument("--layers", type=int, default=64, help="distinct matrices per call (past the caches)")
    parser.add_argument("--repeats", type=int, default=20)


def _median_ms(call, repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def run(args: argparse.Namespace) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, columns, group = args.rows, args.columns, args.group
    weights = [torch.randn(rows, columns, generator=generator) * 0.05 for _ in range(args.layers)]
    pieces = [
        Int4Piece(
            torch.randint(0, 16, (rows, columns), generator=generator, dtype=torch.uint8),
            torch.randint(0, 16, (rows, columns // group), generator=generator, dtype=torch.uint8),
            torch.rand(rows, columns // group, generator=generator).half().float() * 0.01,
            torch.arange(columns) // group,
        )
        for _ in range(args.layers)
    ]
    uint4_zp = [pack_uint4_zp(piece, group) for piece in pieces]
    int4 = [quantize_rows(weight, 4, group) for weight in weights]
    bf16 = [weight.to(torch.bfloat16) for weight in weights]
    packed = [prepack(weight) for weight in bf16]
    del weights, pieces
    print(f"CPU: {describe_machine('cpu')}; {torch.get_num_threads()} threads; kernels' path: "
          f"{quantized_matmul.auto_path(torch.bfloat16)}")
    table = []
    for tokens in args.tokens:
        x = torch.randn(tokens, columns, generator=generator).to(torch.bfloat16)
        setups = [
            ("bf16 (oneDNN-packed)", lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), packed,
             bf16[0].nbytes),
            ("bf16 (F.linear)", lambda w: F.linear(x, w), bf16, bf16[0].nbytes),
            (f"int4 group {group} (at load)", lambda w: quantized_matmul.linear(x, w, quantized_matmul.INT4, group, columns),
             int4, int4[0].nbytes),
            (f"AWQ/GPTQ 4-bit group {group}",
             lambda w: quantized_matmul.linear(x, w, quantized_matmul.UINT4_ZP, group, columns), uint4_zp, uint4_zp[0].nbytes),
        ]
        baseline = None
        for label, matmul, layers, nbytes in setups:
            ms = _median_ms(lambda: [matmul(w) for w in layers], args.repeats) / len(layers)
            baseline = baseline or ms
            table.append((tokens, label, f"{ms:.3f}", ratio(baseline, ms), f"{nbytes / 2**10:.0f}"))
    print(markdown_table(["tokens", "weights", "ms / matmul", "speed vs packed bf16", "weight KiB"], table))


if __name__ == "__main__":
    main()
