"""A worker's resident memory across consecutive batches: flat, or growing with every batch?

Runs what a GPU worker runs for a batch, in-process and without Celery or the object store: the real engine
behind an `EngineLoop`, the generation kind's `run_chunk` (validation, submission, records, the output's bytes) on a
pool of `--concurrency` threads, as Celery's thread pool runs chunks, then the same pool's threads idle. Each
variant runs in a fresh process (resident memory is a property of the process's history) and reports its RSS after
the engine is built and warmed, then after each of `--batches` batches of `--lines` chat lines:

  as shipped   glibc's default (an arena per thread that allocates, up to 8 per core, keeping what Python and
               torch free), and a prefix cache that takes a fresh KV block before reusing a cached one
  trimmed      malloc arenas capped at start and `malloc_trim` after every chunk (`jobs.run.memory`)
  fixed        trimmed, and the CPU pool's cached blocks reused before fresh ones (`BlockManager
               .reuse_cached_before_fresh`): the worker as it runs now

The figure that matters is the growth from the first batch to the last: a leak grows every batch, fragmentation
settles, a fixed worker stays within ~10 %. Two more columns say where the memory is: Python's live blocks
(`sys.getallocatedblocks`, after a collection) after the last batch, which a leak of records or detokenizer state
would grow, and the RSS once `malloc_trim` has run in the as-shipped process: what it gives back was free memory
glibc kept, not live data. `KV touched` is the KV pool's blocks ever used, in MiB: a CPU pool is lazily zeroed
memory, so that much of it is in the process.

    python -m bench.worker_memory --lines 400 --batches 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from redis import Redis

from engine.engine_loop import EngineLoop
from engine.kv_cache import bytes_per_block
from engine.llm_engine import LLMEngine
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from jobs.models import Batch
from jobs.run.generation import GenerationKind
from jobs.run.kinds import EngineHandle
from jobs.run.memory import cap_malloc_arenas, return_freed_memory
from jobs.served_models import ModelNames, process_models
from jobs.settings import S3Settings, Settings
from jobs.stop_flags import StopFlags
from jobs.storage import ObjectStore

CHAT = "/v1/chat/completions"
VARIANTS = ("as shipped", "trimmed", "fixed")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def python_blocks() -> float:
    gc.collect()
    return float(sys.getallocatedblocks())


def chat_lines(batch_number: int, count: int, max_tokens: int) -> list[bytes]:
    return [
        json.dumps(
            {
                "custom_id": f"b{batch_number}-{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": DEFAULT_MODEL,
                    "messages": [{"role": "user", "content": f"Write a line about the number {i} and batch {batch_number}."}],
                    "max_tokens": max_tokens,
                },
            }
        ).encode()
        for i in range(count)
    ]


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, list[float] | float]:
    """RSS (MiB) after warm-up, then after each batch, in this process; Python's live blocks after warm-up and after
    the last batch; the RSS after a malloc_trim at the end."""
    trimmed = variant != "as shipped"
    if trimmed:
        cap_malloc_arenas()
    loop = EngineLoop.build(lambda: LLMEngine(DEFAULT_MODEL, dtype="float32", device="cpu", max_num_seqs=args.max_num_seqs))
    engine = loop.engine
    assert engine.tokenizer is not None
    blocks = engine.block_manager
    blocks.reuse_cached_before_fresh = variant == "fixed"  # set before the engine has run anything
    block_mib = bytes_per_block(engine.model_config, engine.config.block_size, engine.dtype) / 2**20
    redis = Redis.from_url(args.redis_url)
    handle = EngineHandle(
        loop=loop,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        model_name=DEFAULT_MODEL,
        served=ModelNames(process_models([DEFAULT_MODEL], DEFAULT_EMBEDDING_MODEL), {}),
        admission_limits=engine.admission_limits,
    )
    kind = GenerationKind(
        handle,
        ObjectStore(S3Settings()),
        StopFlags(redis, f"bench-memory-{secrets.token_hex(4)}:"),
        args.chunk_size,
        limits=Settings().batch_limits(),
    )

    def run_batch(number: int, lines: list[bytes]) -> None:
        batch = Batch(id=f"batch_bench{number}", endpoint=CHAT, model=DEFAULT_MODEL, priority=0)
        numbered = list(enumerate(lines, 1))
        chunks = [numbered[start : start + args.chunk_size] for start in range(0, len(numbered), args.chunk_size)]

        def run_chunk(index: int) -> None:
            result = kind.run_chunk(batch, index, chunks[index])
            assert result.completed + result.failed == len(chunks[index])
            if trimmed:
                return_freed_memory()

        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(run_chunk, range(len(chunks))))

    try:
        run_batch(0, chat_lines(0, args.chunk_size, args.max_tokens))  # warm-up: one chunk
        figures = [rss_mib()]
        python = [python_blocks()]
        for number in range(1, args.batches + 1):
            started = time.monotonic()
            run_batch(number, chat_lines(number, args.lines, args.max_tokens))
            figures.append(rss_mib())
            print(f"{variant}: batch {number} in {time.monotonic() - started:.0f} s, RSS {figures[-1]:.0f} MiB", file=sys.stderr)
        python.append(python_blocks())
        kv_touched = (blocks.num_blocks - blocks.num_fresh_blocks) * block_mib
        return_freed_memory()
        return {"rss": figures, "python_blocks": python, "rss_trimmed": rss_mib(), "kv_touched": kv_touched}
    finally:
        loop.stop()
        redis.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=400, help="chat lines per batch")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=100, help="lines per chunk (CONVEYOR_CHUNK_SIZE)")
    parser.add_argument("--concurrency", type=int, default=4, help="chunk threads (CONVEYOR_WORKER_CONCURRENCY)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant here and print its figures as JSON")
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(run_variant(args.variant, args)))
        return

    rows = []
    for variant in VARIANTS:
        argv = [sys.executable, "-m", "bench.worker_memory", *sys.argv[1:], "--variant", variant]
        output = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True, env=os.environ).stdout
        rows.append((variant, json.loads(output.strip().splitlines()[-1])))
    print(
        f"{args.batches} batches of {args.lines} chat lines, max_tokens {args.max_tokens}, chunks of {args.chunk_size}, "
        f"{args.concurrency} chunk threads, SmolLM2-135M float32 on CPU; RSS in MiB\n"
    )
    header = [
        "variant", "warm", *(f"after batch {n}" for n in range(1, args.batches + 1)), "last / first batch",
        "Python blocks warm → last (k)", "after malloc_trim", "KV touched",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for variant, result in rows:
        rss, blocks = result["rss"], result["python_blocks"]
        cells = [
            variant, *(f"{figure:.0f}" for figure in rss), f"{rss[-1] / rss[1]:.3f}",
            f"{blocks[0] / 1000:.0f} → {blocks[1] / 1000:.0f}", f"{result['rss_trimmed']:.0f}",
            f"{result['kv_touched']:.0f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
