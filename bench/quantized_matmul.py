"""One projection's matmul at decode sizes on the CPU, bf16 activations, in one process: the quantized kernels'
float32 path (bf16 x converted, the float32 weights, float32 FMAs), their avx512_bf16 path (the dequantized
tile rounded to bf16, bf16 dot products) and their int8-activation path (`matmul_int8`: x quantized to int8, integer
dot products on the blocks' quants; AMX tiles and, beside them, AVX-512 VNNI where the CPU has both) against oneDNN's
bf16 matmul of the unquantized weight (prepacked, as the engine's bf16 models run it, and plain `F.linear`).

    python -m bench.quantized_matmul --shapes 1536x576 4096x2048 --tokens 1 4 16 --formats Q8_0 int8 Q4_1

Each timed call multiplies as many different matrices of the shape as hold `--min-mib` of bf16 weights, one after
the other, as a decode step does, so the weights come from memory rather than a cache. The rows of one shape and
token count are timed in turns, one call each per round over `--repeats` rounds after a warm-up round, so that a
machine whose load changes slows them alike; a row is its median call divided by the matrices. The kernels' rows
time `quantized_matmul.matmul` (float32 out), the step `linear` takes at up to 32 tokens, less its cast to bf16.
"""

from __future__ import annotations

import argparse
import math
import time

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from bench.common import markdown_table, ratio, run_cli
from bench.report import describe_machine
from engine.quantization.unquantized import prepack
from engine.quantization.weight_only import quantize_rows
from conveyor_kernels import quantized_matmul
from conveyor_kernels.quantized_matmul import GGUF_FORMATS

_GROUP = 64  # int8 / int4 group size, the engine's default


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=["1536x576", "4096x2048"],
                        help="ROWSxCOLUMNS (output x input features); default SmolLM2's gate/up and a 7B-class one")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--formats", nargs="+", default=["Q8_0", "int8", "Q4_1"],
                        help=f"GGUF types ({', '.join(GGUF_FORMATS)}) or int8 / int4 (group {_GROUP})")
    parser.add_argument("--min-mib", type=float, default=256, help="bf16 weight MiB per timed call (past the caches)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice, the core count)")


def _quantize(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, int, int]:
    """(blocks, format id, group) of a float32 weight: gguf-py's quantizer, or the weight-only groups."""
    if name in ("int8", "int4"):
        bits = int(name[3:])
        return quantize_rows(weight, bits, _GROUP), quantized_matmul.INT8 if bits == 8 else quantized_matmul.INT4, _GROUP
    blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(blocks)), GGUF_FORMATS[name][0], 0


def _interleaved_median_ms(calls: list[list], repeats: int) -> list[float]:
    """Per setup (a list of calls, one per matrix), the median over `repeats` rounds of the ms all its calls take,
    the setups timed in turns each round, after one warm-up round."""
    times: list[list[float]] = [[] for _ in calls]
    for round_ in range(repeats + 1):
        for setup, setup_calls in enumerate(calls):
            start = time.perf_counter()
            for call in setup_calls:
                call()
            if round_:
                times[setup].append(time.perf_counter() - start)
    return [sorted(t)[len(t) // 2] * 1e3 for t in times]


def run(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    paths = [quantized_matmul.best_isa()] + (["avx512_bf16"] if quantized_matmul.has_avx512_bf16() else [])
    # AMX's tiles beside the VNNI body they replace, where the CPU has both
    auto_int8 = quantized_matmul.int8_path()
    int8_paths = [auto_int8] + (["avx512_vnni"] if auto_int8 == "amx_int8" else [])
    print(f"CPU: {describe_machine('cpu')}; {torch.get_num_threads()} threads; kernel paths: {', '.join(paths)}; "
          f"int8 activations: {', '.join(int8_paths)}")
    generator = torch.Generator().manual_seed(0)
    table = []
    for shape in args.shapes:
        rows, columns = (int(n) for n in shape.split("x"))
        count = max(2, math.ceil(args.min_mib * 2**20 / (rows * columns * 2)))
        weights = [torch.randn(rows, columns, generator=generator) * 0.05 for _ in range(count)]
        bf16 = [weight.to(torch.bfloat16) for weight in weights]
        packed = [prepack(weight) for weight in bf16]
        quantized = {name: [_quantize(weight, name) for weight in weights] for name in args.formats}
        packed_int8 = {name: [quantized_matmul.pack_int8(w, f, g, columns) for w, f, g in layers]
                       for name, layers in quantized.items()}
        del weights
        for tokens in args.tokens:
            x = torch.randn(tokens, columns, generator=generator).to(torch.bfloat16)
            setups = [
                ("bf16, oneDNN-packed", [lambda w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                         for w in packed], bf16[0].nbytes),
                ("bf16, F.linear", [lambda w=w: F.linear(x, w) for w in bf16], bf16[0].nbytes),
            ]
            for name, layers in quantized.items():
                for path in paths:
                    setups.append((f"{name}, {path} kernel",
                                   [lambda w=w, f=f, g=g, p=path: quantized_matmul.matmul(x, w, f, g, p)
                                    for w, f, g in layers], layers[0][0].nbytes))
                for int8_path in int8_paths:
                    setups.append((f"{name}, int8 activations, {int8_path}",
                                   [lambda w=w, p=int8_path: quantized_matmul.matmul_int8(x, w, p)
                                    for w in packed_int8[name]], packed_int8[name][0].nbytes))
            per_matmul = [total / len(calls) for (_, calls, _), total in
                          zip(setups, _interleaved_median_ms([calls for _, calls, _ in setups], args.repeats))]
            for (label, _, nbytes), ms in zip(setups, per_matmul):
                table.append((shape, tokens, label, f"{ms:.3f}", ratio(per_matmul[0], ms), f"{nbytes / 2**10:.0f}"))
            print(f"  {shape}, {tokens} tokens: done", flush=True)
    print(markdown_table(["shape", "tokens", "weights, path", "ms / matmul", "speed vs packed bf16", "weight KiB"],
                         table))


if __name__ == "__main__":
    main()
