"""Tensor parallelism: the same workload with the model sharded over 1, 2, 3 ... ranks.

Workload: R requests of P random prompt tokens, each generating O tokens greedily (`ignore_eos`), all submitted
at t=0, on a fresh engine per size (dummy weights: timing only; tests/engine/test_tensor_parallel.py checks the
tokens). Per size: wall time, output tokens/s, milliseconds per engine step, and rank 0's time inside the
collectives per step (the all-reduce after every row-parallel layer and the embedding, the logits gather: transfer
plus waiting for the slowest rank), with their count and payload per step.

On a CPU the ranks are processes sharing the same cores, so no speed-up is expected: the figure to read is the
communication cost per step. On a GPU node the same command measures the real thing, e.g. the Llama-3-70B shape
over 8 GPUs (docs/performance.md has the roofline prediction):

    OMP_NUM_THREADS=1 python -m bench.tensor_parallel                       # CPU, sizes 1 2 3, a small Llama shape
    python -m bench.tensor_parallel --model llama-3-70b --device cuda --tensor-parallel-sizes 8 \\
        --num-requests 256 --prompt-len 512 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import markdown_table, ratio, run_cli
from engine import LLM, SamplingParams

# A Llama shape whose heads (12, KV 6) and MLP width divide by 1, 2, 3 and 6, small enough for a 2-core machine.
CPU_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_key_value_heads": 6, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


@dataclass
class CollectiveClock:
    """Time rank 0 spends inside torch.distributed's all_reduce and gather, and what they carried."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    @contextmanager
    def watching(self, synchronize: Callable[[], None]) -> Iterator[None]:
        originals = {name: getattr(dist, name) for name in ("all_reduce", "gather")}

        def timed(original: Callable[..., object]) -> Callable[..., object]:
            def call(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
                synchronize()
                started = time.perf_counter()
                result = original(tensor, *args, **kwargs)
                synchronize()
                self.seconds += time.perf_counter() - started
                self.calls += 1
                self.bytes += tensor.numel() * tensor.element_size()
                return result

            return call

        for name, original in originals.items():
            setattr(dist, name, timed(original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)


@dataclass(frozen=True)
class SizeRun:
    size: int
    seconds: float
    output_tokens: int
    steps: int
    clock: CollectiveClock

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / self.steps


def run_size(args: argparse.Namespace, model: str, size: int, prompts: list[list[int]]) -> SizeRun:
    llm = LLM(
        model=model, dtype=args.dtype, device=args.device, load_format="dummy", tensor_parallel_size=size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.num_requests,
    )
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, params)
        clock = CollectiveClock()
        synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        steps_before = engine.counters.steps
        output_tokens = 0
        synchronize()
        started = time.perf_counter()
        with clock.watching(synchronize):
            while engine.has_unfinished_requests():
                output_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        synchronize()
        seconds = time.perf_counter() - started
        return SizeRun(size, seconds, output_tokens, engine.counters.steps - steps_before, clock)
    finally:
        engine.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a named shape or Hugging Face folder (default: a small Llama shape)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 30000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            (Path(scratch) / "config.json").write_text(json.dumps(CPU_SHAPE))
            model = scratch
        runs = [run_size(args, model, size, prompts) for size in args.tensor_parallel_sizes]
    print(
        f"model={args.model or 'llama-12x768 (CPU_SHAPE)'} dtype={args.dtype} device={args.device} "
        f"requests={args.num_requests} prompt-len={args.prompt_len} output-len={args.output_len} "
        f"threads per rank={torch.get_num_threads()}"
    )
    base = runs[0]
    rows = [
        [
            f"TP={r.size}",
            f"{r.seconds:.2f}",
            f"{r.output_tokens / r.seconds:.1f}",
            ratio(r.output_tokens / r.seconds, base.output_tokens / base.seconds),
            r.steps,
            f"{r.ms_per_step:.1f}",
            f"{1000 * r.clock.seconds / r.steps:.1f}" if r.size > 1 else "-",
            f"{100 * r.clock.seconds / r.seconds:.0f}%" if r.size > 1 else "-",
            f"{r.clock.calls / r.steps:.0f}" if r.size > 1 else "-",
            f"{r.clock.bytes / r.steps / 1e6:.2f}" if r.size > 1 else "-",
        ]
        for r in runs
    ]
    print(markdown_table(
        ["run", "seconds", "output tok/s", f"vs TP={base.size}", "steps", "ms/step",
         "collective ms/step", "share", "collectives/step", "MB/step"],
        rows,
    ))


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
