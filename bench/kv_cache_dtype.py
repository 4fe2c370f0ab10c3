"""The KV cache's capacity with each `kv_cache_dtype`, one process, side by side: the blocks and tokens the engine
allocated in the same `--kv-cache-memory` (read back from the started engine, not computed here), and output tok/s
on a decode-heavy slice of bench/throughput's workload (random prompt ids, greedy, `ignore_eos`, all submitted at
once) with a pool too small for the batch in the model's dtype, so the int8 pool's room shows as fewer preemptions.

Rows: the model's dtype ("auto") and "int8" on the CPU, "auto" and "fp8_e4m3" with `--device cuda` (the pool then
sized by `gpu_memory_utilization`, not `--kv-cache-memory`), on the bundled SmolLM2-135M by default.

    python -m bench.kv_cache_dtype --kv-cache-memory 33554432 --num-requests 32 --prompt-len 64 256 --output-len 128 128
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.common import dtype_name, markdown_table, ratio, run_cli
from bench.report import describe_machine
from bench.throughput import make_workload, run_conveyor
from engine import LLM
from engine.model_registry import DEFAULT_MODEL


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: bf16 where the CPU runs it fast)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--kv-cache-memory", type=int, default=32 << 20, metavar="BYTES")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(128, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    print(f"{describe_machine(args.device)}, load {os.getloadavg()[0]:.1f}", flush=True)
    on_gpu = args.device == "cuda"
    budget = "gpu_memory_utilization 0.9" if on_gpu else f"{args.kv_cache_memory * 2**-20:.0f} MiB"
    pool = {} if on_gpu else {"kv_cache_memory": args.kv_cache_memory}
    rows = []
    baseline: tuple[int, float] | None = None
    for kv_cache_dtype in ("auto", "fp8_e4m3" if on_gpu else "int8"):
        llm = LLM(
            model=args.model, dtype=args.dtype, device=args.device, kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=args.max_num_seqs, seed=args.seed, **pool,
        )
        engine = llm.engine
        cache = engine.runner.kv_caches[0][0]
        tokens = engine.block_manager.num_blocks * engine.config.block_size
        requests = make_workload(
            args.num_requests, tuple(args.prompt_len), tuple(args.output_len), engine.model_config.vocab_size, args.seed
        )
        print(f"{kv_cache_dtype}: {engine.block_manager.num_blocks} blocks, {tokens} tokens", flush=True)
        result = run_conveyor(llm, requests)
        preemptions = sum(engine.stats().preemptions.values())
        if baseline is None:
            baseline = (tokens, result.tokens_per_second)
        rows.append([
            f"{kv_cache_dtype} ({dtype_name(cache.dtype)})",
            budget,
            engine.block_manager.num_blocks,
            tokens,
            ratio(tokens, baseline[0]),
            f"{result.tokens_per_second:.1f}",
            ratio(result.tokens_per_second, baseline[1]),
            preemptions,
        ])
        engine.close()
        del llm
    print(
        f"model={args.model} dtype={args.dtype} device={args.device} requests={args.num_requests} prompt={args.prompt_len[0]}-"
        f"{args.prompt_len[1]} output={args.output_len[0]}-{args.output_len[1]} max_num_seqs={args.max_num_seqs} "
        f"threads={torch.get_num_threads()}"
    )
    print(markdown_table(
        ["kv_cache_dtype", "budget", "blocks", "tokens", "capacity", "output tok/s", "speed", "preemptions"], rows
    ))


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
