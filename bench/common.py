"""What the scheduler and KV-cache benchmarks share: model options, driving an engine to completion
while recording per-request latency and per-step KV usage, and printing a markdown table.

Each run gets a fresh engine (the knobs under test are fixed at construction) and a warm-up request;
the figures a run reports are differences of the engine's counters across the measured part only.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.model_registry import DEFAULT_MODEL
from engine.outputs import RequestOutput


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16: how a table names the dtype that ran (`--dtype auto` resolves per host)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Submission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class StepSample:
    """The engine right after one measured step."""

    kv_blocks_used: int
    prompt_tokens_computed: int  # since the measured part began
    sequences: int  # scheduled in this step


@dataclass(frozen=True)
class Run:
    name: str
    seconds: float
    outputs: dict[str, RequestOutput]  # by request id
    latencies: dict[str, float]  # seconds from submission (all at t=0) to the step that finished it
    steps: list[StepSample]
    start: EngineStats
    end: EngineStats

    @property
    def output_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs.values() for c in o.outputs)

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_second(self) -> float:
        return len(self.outputs) / self.seconds

    @property
    def prompt_tokens_computed(self) -> int:
        return self.end.counters.prompt_tokens_computed - self.start.counters.prompt_tokens_computed

    @property
    def positions_computed(self) -> int:
        """Prompt chunks and decodes: every position that went through the model."""
        return self.end.counters.batched_tokens - self.start.counters.batched_tokens

    def preemptions(self, mode: str) -> int:
        return self.end.preemptions.get(mode, 0) - self.start.preemptions.get(mode, 0)

    @property
    def blocks_swapped_out(self) -> int:
        return self.end.blocks_swapped_out - self.start.blocks_swapped_out

    @property
    def blocks_swapped_in(self) -> int:
        return self.end.blocks_swapped_in - self.start.blocks_swapped_in

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.end.prefix_cache_queried_tokens - self.start.prefix_cache_queried_tokens
        hits = self.end.prefix_cache_hit_tokens - self.start.prefix_cache_hit_tokens
        return hits / queried if queried else 0.0

    @property
    def peak_kv_blocks_used(self) -> int:
        return max(s.kv_blocks_used for s in self.steps)

    def latency_percentile(self, q: float) -> float:
        return percentile(list(self.latencies.values()), q)

    def token_ids(self, request_id: str) -> list[list[int]]:
        """The request's samples' output token ids, by sample index."""
        return [c.token_ids for c in sorted(self.outputs[request_id].outputs, key=lambda c: c.index)]


def run_cli(
    description: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], None],
    argv: list[str] | None = None,
) -> None:
    """A benchmark module's `main`: its docstring as help, its arguments, its run."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice, the core count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")


def setup_torch(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)


def load(args: argparse.Namespace, **engine_options: object) -> LLM:
    return LLM(
        model=args.model, dtype=args.dtype, device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, **engine_options,
    )


def describe(args: argparse.Namespace, llm: LLM, **workload: object) -> str:
    """The line a benchmark prints before its runs: model, dtype, device, workload, threads."""
    details = " ".join(f"{name.replace('_', '-')}={value}" for name, value in workload.items())
    return (
        f"model={llm.model_name} dtype={args.dtype} device={args.device} {details} "
        f"threads={torch.get_num_threads()}"
    )


def drive(name: str, llm: LLM, submissions: Sequence[Submission]) -> Run:
    """Warm up, submit everything at once, then step until all finished."""
    engine = llm.engine
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    start_stats = engine.stats()
    start = time.perf_counter()
    for s in submissions:
        engine.add_request(s.request_id, s.prompt_token_ids, s.params)
    outputs: dict[str, RequestOutput] = {}
    latencies: dict[str, float] = {}
    steps: list[StepSample] = []
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
        now = time.perf_counter() - start
        for output in finished:
            outputs[output.request_id] = output
            latencies[output.request_id] = now
        steps.append(_sample(engine, start_stats))
    seconds = time.perf_counter() - start
    return Run(name, seconds, outputs, latencies, steps, start_stats, engine.stats())


def _sample(engine: LLMEngine, start: EngineStats) -> StepSample:
    stats = engine.stats()
    return StepSample(
        kv_blocks_used=stats.kv_blocks_used,
        prompt_tokens_computed=stats.counters.prompt_tokens_computed - start.counters.prompt_tokens_computed,
        sequences=stats.counters.last_step_sequences,
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the nearest ranks (numpy's default)."""
    return float(np.percentile(values, q))


def ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline else "n/a"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table, padded so it also reads as plain text; the first column is left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        padded = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    rule = "| " + " | ".join([":" + "-" * (widths[0] - 1)] + ["-" * (w - 1) + ":" for w in widths[1:]]) + " |"
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])
