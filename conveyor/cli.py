"""The `conveyor` command line. Each subcommand is an `_add_<name>_command` that registers its parser and handler."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from engine.model_registry import DEFAULT_MODEL

Handler = Callable[[argparse.Namespace], int]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor", description="OpenAI-compatible batch inference.")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_command(subcommands)
    _add_bench_command(subcommands)
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


def _add_run_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = subcommands.add_parser(
        "run",
        help="run an OpenAI Batch input file (JSONL) locally and write the results file",
        description="Run every request of an OpenAI Batch input file on a local engine. The output has one "
        "line per input line, in input order: a response, or an error record for a line that could not run.",
    )
    run.add_argument("-i", "--input", required=True, type=Path, help="OpenAI Batch input file (JSONL)")
    run.add_argument("-o", "--output", required=True, type=Path, help="where to write the results (JSONL)")
    run.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name, .gguf file or model folder (default: {DEFAULT_MODEL})"
    )
    run.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    run.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    run.add_argument("--max-num-seqs", type=int, help="sequences in the running batch at once")
    run.add_argument("--max-num-batched-tokens", type=int, help="tokens computed in one engine step")
    run.add_argument("--kv-cache-memory", type=int, metavar="BYTES", help="KV cache size on CPU, in bytes")
    run.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    input_path: Path = args.input
    output_path: Path = args.output
    # Checked before loading the model, which takes a while, so a typo fails at once.
    if not input_path.is_file():
        return _fail(f"input file not found: {input_path}")
    if not output_path.parent.is_dir():
        return _fail(f"output folder does not exist: {output_path.parent}")
    if output_path.resolve() == input_path.resolve():
        return _fail("the output file must differ from the input file")

    from conveyor.run_file import run_batch_file
    from engine import LLM

    engine_options = {
        name: value
        for name, value in (
            ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("kv_cache_memory", args.kv_cache_memory),
        )
        if value is not None
    }
    try:
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, **engine_options)
    except (ValueError, OSError) as failure:
        return _fail(f"cannot start the engine with model {args.model!r}: {failure}")

    summary = run_batch_file(input_path, output_path, llm, progress=sys.stderr.isatty())

    failures = ", ".join(f"{count} {code}" for code, count in sorted(summary.failures_by_code.items()))
    print(
        f"conveyor run: {summary.total} requests, {summary.succeeded} succeeded, {summary.failed} failed"
        + (f" ({failures}; see their error records)" if failures else "")
        + f"; results in {output_path}",
        file=sys.stderr,
    )
    return 0


def _add_bench_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from bench import throughput

    bench = subcommands.add_parser(
        "bench",
        help="offline throughput: conveyor vs Hugging Face static-batch generate on the same requests",
        description=throughput.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    throughput.add_arguments(bench)
    bench.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from bench import throughput

    throughput.run(args)
    return 0


def _fail(message: str) -> int:
    print(f"conveyor: error: {message}", file=sys.stderr)
    return 1
