"""The command-line options of `bench.throughput` and `bench.report`, apart from the modules that run them: those
import torch and the engine (seconds on a busy machine), which `conveyor bench --help` must not wait for."""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path

from engine.model_registry import DEFAULT_MODEL

REPORT_SIZES = ("tiny", "small", "default", "gpu")  # the keys of bench.report.SIZES
CLOCKS = ("cpu", "wall")  # the keys of bench.scheduling_runs.CLOCKS


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--dtype", default="auto",
        help="auto (the engine's default): bfloat16 where the host has fast bf16, else float32",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=64, help="requests per HF static batch")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
        help="the engine's KV cache storage: auto (the model's dtype), int8 (CPU), fp8_e4m3 (CUDA)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="only run conveyor")
    parser.add_argument("--small", action="store_true", help="a named dummy shape cut to a few narrow layers")
    parser.add_argument(
        "--skip-profile", action="store_true", help="no second, profiled conveyor pass (the per-step split; CPU only)"
    )


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder for report.md, the plots and the CSVs")
    parser.add_argument("--size", choices=REPORT_SIZES, default="default", help="tiny: a smoke run; small: a few minutes; gpu: for a GPU")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--dtype", default="auto",
        help="auto (the engine's default): bfloat16 where the host has fast bf16, else float32",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice, the core count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock", choices=CLOCKS, default="wall",
        help="wall: wall time; cpu: this process's CPU time, single-threaded (sets --threads 1), idle gaps "
        "skipped: on a shared machine, the time on one quiet core",
    )


def module_docstring(module: str) -> str | None:
    """A module's docstring, read from its source without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text()), clean=False)
