"""The KV cache's capacity with each `kv_cache_dtype`, one process, side by side: the blocks and tokens the engine
allocated in the same `--kv-cache-memory` (read back from the started engine, not computed here), and output tok/s
on a decode-heavy slice of bench/throughput's workload (random prompt ids, greedy, `ignore_eos`, all submitted at
once) with a pool too small for the batch in the model's dtype, so the int8 pool's room shows as fewer preemptions.

Rows: the model's dtype ("auto") and "int8" on the CPU, "auto" and "fp8_e4m3" with `--device cuda` (the pool then
sized by `gpu_memory_utilization`, not `--kv-cache-memory`), on the bundled SmolLM2-135M by default.

On the CPU two more things, in the same run: a third tok/s row, int8 with the decode attention forced to the
portable C++ kernel (what every int8 cache ran before the AVX-512 / AVX2 kernels), and the decode attention alone
per layer in the model's head shape (`--attention-seqs` sequences of `--attention-len` positions, scattered blocks):
a float32 cache, a bf16 cache and the int8 cache on each of its paths, timed in interleaved rounds (the median of
each), so that a busy machine slows every row alike. Both tables give CPU-time figures beside the wall clock's (on
a busy machine the wall clock also counts waiting for a core; `OMP_NUM_THREADS=1` keeps a parallel region from
waiting on a thread that has none).

    python -m bench.kv_cache_dtype --kv-cache-memory 33554432 --num-requests 32 --prompt-len 64 256 --output-len 128 128
    python -m bench.kv_cache_dtype --attention-only --attention-shape 32 8 128  # the attention table alone
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import nullcontext
from functools import partial
from unittest import mock

import torch

from bench.common import dtype_name, markdown_table, ratio, run_cli
from bench.report import describe_machine
from bench.throughput import make_workload, run_conveyor
from engine import LLM
from engine.dtypes import resolve_dtype
from engine.model_registry import DEFAULT_MODEL
from conveyor_kernels import cpu_kernels, kv_quant, paged_attention


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
    parser.add_argument("--attention-seqs", type=int, default=64, help="decode attention alone: sequences")
    parser.add_argument("--attention-len", type=int, default=400, help="decode attention alone: positions each")
    parser.add_argument("--attention-rounds", type=int, default=20, help="decode attention alone: timed rounds")
    parser.add_argument(
        "--attention-shape", type=int, nargs=3, metavar=("HEADS", "KV_HEADS", "HEAD_DIM"),
        help="decode attention alone in this head shape instead of the model's; with it, --attention-only skips the "
        "end-to-end runs",
    )
    parser.add_argument("--attention-only", action="store_true")


def run(args: argparse.Namespace) -> None:
    print(f"{describe_machine(args.device)}, load {os.getloadavg()[0]:.1f}", flush=True)
    if args.attention_only:
        if args.attention_shape is None:
            raise SystemExit("--attention-only needs --attention-shape HEADS KV_HEADS HEAD_DIM")
        print_attention_table(*args.attention_shape, resolve_dtype(args.dtype, torch.device("cpu")), args)
        return
    on_gpu = args.device == "cuda"
    budget = "gpu_memory_utilization 0.9" if on_gpu else f"{args.kv_cache_memory * 2**-20:.0f} MiB"
    pool = {} if on_gpu else {"kv_cache_memory": args.kv_cache_memory}
    # (kv_cache_dtype, the int8 decode attention's path, forced by name where not None)
    runs = [("auto", None), ("fp8_e4m3", None)] if on_gpu else [("auto", None), ("int8", None), ("int8", "portable")]
    rows = []
    baseline: tuple[int, float, float] | None = None
    model: tuple[int, int, int, torch.dtype] | None = None  # heads, kv heads, head_dim; the cache's dtype in auto
    for kv_cache_dtype, int8_path in runs:
        llm = LLM(
            model=args.model, dtype=args.dtype, device=args.device, kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=args.max_num_seqs, seed=args.seed, **pool,
        )
        engine = llm.engine
        cache = engine.runner.kv_caches[0][0]
        shape = engine.model_config
        model = model or (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim, cache.dtype)
        tokens = engine.block_manager.num_blocks * engine.config.block_size
        requests = make_workload(
            args.num_requests, tuple(args.prompt_len), tuple(args.output_len), engine.model_config.vocab_size, args.seed
        )
        print(f"{kv_cache_dtype}: {engine.block_manager.num_blocks} blocks, {tokens} tokens", flush=True)
        # The engine's paged attention calls the C++ decode attention by this name; a bench-only override.
        forced = partial(cpu_kernels.paged_decode_attention, path=int8_path)
        cpu_start = time.process_time()
        with mock.patch.object(paged_attention, "paged_decode_attention", forced) if int8_path else nullcontext():
            result = run_conveyor(llm, requests)
        # Output tokens per second of this process's CPU time (all its threads'): on a busy machine the wall clock
        # also counts the time spent waiting for a core.
        per_cpu_second = result.output_tokens / (time.process_time() - cpu_start)
        preemptions = sum(engine.stats().preemptions.values())
        if baseline is None:
            baseline = (tokens, result.tokens_per_second, per_cpu_second)
        rows.append([
            f"{kv_cache_dtype} ({dtype_name(cache.dtype)})" + (f", {int8_path} attention" if int8_path else ""),
            budget,
            engine.block_manager.num_blocks,
            tokens,
            ratio(tokens, baseline[0]),
            f"{result.tokens_per_second:.1f}",
            ratio(result.tokens_per_second, baseline[1]),
            f"{per_cpu_second:.1f}",
            ratio(per_cpu_second, baseline[2]),
            preemptions,
        ])
        engine.close()
        del llm
    print(
        f"model={args.model} dtype={args.dtype} device={args.device} requests={args.num_requests} prompt={args.prompt_len[0]}-"
        f"{args.prompt_len[1]} output={args.output_len[0]}-{args.output_len[1]} max_num_seqs={args.max_num_seqs} "
        f"threads={torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}"
    )
    print(markdown_table(
        ["kv_cache_dtype", "budget", "blocks", "tokens", "capacity", "output tok/s", "speed", "tok / CPU s", "speed",
         "preemptions"],
        rows,
    ))
    if not on_gpu and model is not None:
        heads, kv_heads, head_dim, dtype = model
        print_attention_table(*(args.attention_shape or (heads, kv_heads, head_dim)), dtype, args)


def print_attention_table(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, args: argparse.Namespace) -> None:
    """Per-layer decode attention, one call per cache kind and path, in interleaved rounds; queries in `dtype`."""
    seqs, length, block_size = args.attention_seqs, args.attention_len, 16
    generator = torch.Generator().manual_seed(args.seed)
    per_seq = -(-length // block_size)
    num_blocks = seqs * per_seq + 1
    tables = torch.randperm(num_blocks, generator=generator)[: seqs * per_seq].view(seqs, per_seq).int()
    lens = torch.full((seqs,), length, dtype=torch.int32)
    k, v = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator) for _ in range(2))
    query = torch.randn(seqs, heads, head_dim, generator=generator)
    int8_k, int8_v = kv_quant.quantize(k, torch.int8), kv_quant.quantize(v, torch.int8)
    cases = {  # name -> (query, K cache, V cache, int8 path)
        "float32": (query, k, v, None),
        dtype_name(dtype): (query.to(dtype), k.to(dtype), v.to(dtype), None),
    }
    for path in reversed(cpu_kernels.vector_decode_paths(head_dim, dtype, torch.int8)):
        cases[f"int8, {path}"] = (query.to(dtype), int8_k, int8_v, path)
    # Wall-clock and CPU time (all threads'): on a busy machine a thread waiting for a core shows in the first only.
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for round_ in range(args.attention_rounds + 2):  # two warm-up rounds
        for name, (q, k_cache, v_cache, path) in cases.items():
            out = torch.empty_like(q)
            start, cpu_start = time.perf_counter(), time.process_time()
            cpu_kernels.paged_decode_attention(
                q, k_cache, v_cache, tables, lens, torch.arange(seqs), head_dim**-0.5, out, path=path or "auto"
            )
            if round_ >= 2:
                times[name].append((time.perf_counter() - start, time.process_time() - cpu_start))
    median = {name: [sorted(t[i] for t in runs)[len(runs) // 2] * 1e3 for i in (0, 1)] for name, runs in times.items()}
    reference = median[dtype_name(dtype)]
    print(
        f"decode attention per layer: {seqs} sequences x {length} positions, {heads} heads / {kv_heads} kv heads x "
        f"{head_dim}, block {block_size}, queries {dtype_name(dtype)} (float32 for the float32 cache), "
        f"threads={torch.get_num_threads()}, median of {args.attention_rounds} rounds, load {os.getloadavg()[0]:.1f}"
    )
    print(markdown_table(
        ["cache, path", "K/V MiB", "ms / layer", f"vs {dtype_name(dtype)}", "CPU ms / layer", f"vs {dtype_name(dtype)}"],
        [
            [name, f"{(k_cache.nbytes + v_cache.nbytes) * 2**-20 * seqs * per_seq / num_blocks:.1f}",
             f"{wall:.2f}", ratio(wall, reference[0]), f"{cpu:.2f}", ratio(cpu, reference[1])]
            for (name, (wall, cpu)), (_, k_cache, v_cache, _) in zip(median.items(), cases.values())
        ],
    ))


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
