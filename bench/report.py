"""The continuous-batching report: the same engine and kernels under static batching (admit a batch,
run it until its longest member is done, then the next) and continuous batching, with Hugging Face
transformers' static `generate` as an outside reference; then the batch-job scheduling policies
(prefix-aware ordering, lookahead admission, least-work victims) against arrival order.

    python -m bench.report --out report/                          # ~10 minutes on a quiet 2-core CPU
    python -m bench.report --out report/ --size small             # a few minutes: the README's plots
    python -m bench.report --out report/ --size tiny              # a smoke run (what the test runs)
    python -m bench.report --out report/ --size gpu --device cuda
    conveyor bench report --out report/                           # the same

Writes report.md, PNG plots and the raw numbers (runs.csv, steps.csv) into --out. Seeded: every run
replays the same requests (random token prompts, greedy, ignore_eos, so every policy does the same
work); the times are this machine's, the ratios are measured side by side in one run.

1. Output-length spread (all equal -> long tail), all requests at t=0: static, continuous, HF static.
2. Poisson arrivals at fractions of continuous batching's measured capacity: static and continuous.
3. max_num_batched_tokens (the prefill chunk), all at t=0: throughput against time to first token.
4. Prefix-aware ordering: a shuffled job of documents x questions, in a pool that holds few documents.
5. Lookahead admission and least-work victims on a mixed workload under memory pressure.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import dtype_name, markdown_table, run_cli
from bench.options import add_report_arguments
from bench.scheduling_runs import (
    SPREADS,
    Measured,
    all_at_once,
    document_job,
    output_lengths,
    percentile,
    poisson,
    random_prompts,
    run_engine,
)
from bench.throughput import BenchRequest, run_hf_static
from engine import LLM
from engine.config import EngineConfig
from engine.dtypes import resolve_dtype
from engine.model_registry import resolve_model, transformers_source


@dataclass(frozen=True)
class ReportSize:
    requests: int  # per run of experiments 1 and 3
    seats: int  # max_num_seqs; also HF's static batch size
    prompt_len: tuple[int, int]  # tokens, uniform
    mean_output_len: int  # tokens, the mean of every spread
    poisson_requests: int  # per run of experiment 2
    arrival_fractions: tuple[float, ...]  # arrival rates, as fractions of continuous batching's capacity
    chunk_sizes: tuple[int, ...]  # max_num_batched_tokens values of experiment 3
    documents: int
    questions: int  # per document
    document_len: int  # tokens
    question_len: int  # tokens
    answer_len: int  # tokens
    pool_documents: int  # the KV pool holds this many whole prompts
    mixed_requests: int
    mixed_prompt_len: tuple[int, int]
    mixed_output_len: tuple[int, int]
    mixed_pool_fraction: float  # KV pool / the blocks every seat's longest request would need
    lookahead_steps: int


SIZES = {
    "tiny": ReportSize(
        requests=8, seats=4, prompt_len=(8, 24), mean_output_len=6, poisson_requests=6, arrival_fractions=(0.5, 1.0),
        chunk_sizes=(16, 256), documents=4, questions=3, document_len=48, question_len=8, answer_len=2,
        pool_documents=2, mixed_requests=8, mixed_prompt_len=(8, 40), mixed_output_len=(2, 12),
        mixed_pool_fraction=0.5, lookahead_steps=4,
    ),
    "small": ReportSize(
        requests=16, seats=4, prompt_len=(8, 48), mean_output_len=12, poisson_requests=12, arrival_fractions=(0.5, 1.0),
        chunk_sizes=(16, 64, 256), documents=20, questions=20, document_len=48, question_len=8, answer_len=1,
        pool_documents=5, mixed_requests=16, mixed_prompt_len=(8, 96), mixed_output_len=(2, 32),
        mixed_pool_fraction=0.4, lookahead_steps=8,
    ),
    "default": ReportSize(
        requests=48, seats=12, prompt_len=(16, 128), mean_output_len=32, poisson_requests=32,
        arrival_fractions=(0.4, 0.7, 1.0), chunk_sizes=(32, 128, 1024), documents=20, questions=20,
        document_len=96, question_len=8, answer_len=2, pool_documents=5, mixed_requests=32,
        mixed_prompt_len=(16, 256), mixed_output_len=(4, 96), mixed_pool_fraction=0.4, lookahead_steps=16,
    ),
    "gpu": ReportSize(
        requests=1024, seats=256, prompt_len=(64, 1024), mean_output_len=256, poisson_requests=1024,
        arrival_fractions=(0.4, 0.7, 0.9, 1.1), chunk_sizes=(256, 1024, 4096, 16384), documents=20, questions=20,
        document_len=2048, question_len=32, answer_len=32, pool_documents=5, mixed_requests=1024,
        mixed_prompt_len=(64, 2048), mixed_output_len=(16, 512), mixed_pool_fraction=0.4, lookahead_steps=32,
    ),
}
POLICY_SPREAD = "uniform 1..2x"  # the spread of experiments 2 and 3
TIMELINE_SPREAD = "long tail"  # the spread whose runs are plotted over time


@dataclass(frozen=True)
class Setting:
    """What one report run shares: the model, where it runs, the size and the seed."""

    model: str
    dtype: str
    device: str
    size: ReportSize
    seed: int
    clock: str  # "wall" or "cpu" (see bench.scheduling_runs.CpuClock)
    block_size: int = 16

    def engine(self, **options: object) -> LLM:
        return LLM(model=self.model, dtype=self.dtype, device=self.device, block_size=self.block_size, **options)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def seats_pool(self, requests: list[BenchRequest]) -> int:
        """KV blocks for every seat to hold the longest request: memory never limits the policies."""
        longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
        return self.size.seats * self.blocks_for(longest) + 1


def spread_experiment(setting: Setting, vocab_size: int) -> list[Measured]:
    size = setting.size
    rng = random.Random(setting.seed)
    prompts = random_prompts(size.requests, size.prompt_len, vocab_size, rng)
    workloads = {
        spread: [BenchRequest(p, n) for p, n in zip(prompts, output_lengths(spread, size.requests, size.mean_output_len, rng))]
        for spread in SPREADS
    }
    runs: list[Measured] = []
    for spread, requests in workloads.items():
        for policy in ("static", "continuous"):
            llm = setting.engine(max_num_seqs=size.seats, scheduling_policy=policy, num_kv_blocks=setting.seats_pool(requests))
            runs.append(run_engine("spread", policy, spread, llm, all_at_once(requests), setting.clock))
            del llm
    runs += hf_runs(setting, workloads)
    return runs


def hf_runs(setting: Setting, workloads: dict[str, list[BenchRequest]]) -> list[Measured]:
    import transformers

    path, arguments = transformers_source(setting.model)
    dtype = resolve_dtype(setting.dtype, torch.device(setting.device))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **arguments)
    model = model.to(setting.device).eval()
    seats = setting.size.seats
    runs = []
    for spread, requests in workloads.items():
        result = run_hf_static(model, requests, seats, time.process_time if setting.clock == "cpu" else time.perf_counter)
        batches = [requests[i : i + seats] for i in range(0, len(requests), seats)]
        runs.append(
            Measured(
                experiment="spread", label="hf static", x=spread, seconds=result.seconds,
                output_tokens=result.output_tokens, seats=seats,
                seat_steps=sum(seats * max(r.output_len for r in batch) for batch in batches),
                latencies=list(result.latencies), ttfts=[],
            )
        )
    return runs


def policy_workload(setting: Setting, vocab_size: int, count: int, seed: int) -> list[BenchRequest]:
    """The requests of experiments 2 and 3: the size's prompts, outputs of POLICY_SPREAD."""
    size = setting.size
    rng = random.Random(seed)
    prompts = random_prompts(count, size.prompt_len, vocab_size, rng)
    lengths = output_lengths(POLICY_SPREAD, count, size.mean_output_len, rng)
    return [BenchRequest(p, n) for p, n in zip(prompts, lengths)]


def arrival_experiment(setting: Setting, vocab_size: int, capacity: float) -> list[Measured]:
    """`capacity`: continuous batching's all-at-once throughput on this spread, in requests/s."""
    size = setting.size
    requests = policy_workload(setting, vocab_size, size.poisson_requests, setting.seed + 1)
    runs = []
    for fraction in size.arrival_fractions:
        rate = fraction * capacity
        arrivals = poisson(requests, rate, random.Random(setting.seed + 2))
        for policy in ("static", "continuous"):
            llm = setting.engine(
                max_num_seqs=size.seats, scheduling_policy=policy, num_kv_blocks=setting.seats_pool(requests)
            )
            runs.append(run_engine("arrival", policy, f"{rate:.3g}", llm, arrivals, setting.clock))
            del llm
    return runs


def chunk_experiment(setting: Setting, vocab_size: int) -> list[Measured]:
    size = setting.size
    requests = policy_workload(setting, vocab_size, size.requests, setting.seed + 3)
    runs = []
    for chunk in size.chunk_sizes:
        llm = setting.engine(max_num_seqs=size.seats, max_num_batched_tokens=chunk, num_kv_blocks=setting.seats_pool(requests))
        runs.append(run_engine("chunk", "continuous", str(chunk), llm, all_at_once(requests), setting.clock))
        del llm
    return runs


def prefix_experiment(setting: Setting, vocab_size: int) -> tuple[list[Measured], int]:
    """Returns the runs and the ideal prefill: every document once, every question once."""
    size = setting.size
    job = document_job(
        size.documents, size.questions, size.document_len, size.question_len, size.answer_len, vocab_size, setting.seed + 4
    )
    prompt_blocks = setting.blocks_for(size.document_len + size.question_len + size.answer_len)
    runs = []
    for label, ordered in (("arrival order", False), ("prefix-aware", True)):
        llm = setting.engine(
            max_num_seqs=size.seats, num_kv_blocks=size.pool_documents * prompt_blocks,
            enable_prefix_caching=True, prefix_aware_ordering=ordered,
        )
        runs.append(run_engine("prefix", label, f"{size.documents}x{size.questions}", llm, all_at_once(job), setting.clock))
        del llm
    ideal = size.documents * size.document_len + len(job) * size.question_len
    return runs, ideal


LOOKAHEAD_VARIANTS = {
    "today (recency victims)": {},
    "lookahead": {"lookahead": True},
    "least-work victims": {"preemption_victim": "least_work"},
    "lookahead + least-work": {"lookahead": True, "preemption_victim": "least_work"},
}


def lookahead_experiment(setting: Setting, vocab_size: int) -> list[Measured]:
    size = setting.size
    rng = random.Random(setting.seed + 5)
    prompts = random_prompts(size.mixed_requests, size.mixed_prompt_len, vocab_size, rng)
    requests = [BenchRequest(p, rng.randint(*size.mixed_output_len)) for p in prompts]
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    pool = max(setting.blocks_for(longest) + 1, int(size.mixed_pool_fraction * size.seats * setting.blocks_for(longest)))
    runs = []
    for label, variant in LOOKAHEAD_VARIANTS.items():
        llm = setting.engine(
            max_num_seqs=size.seats, num_kv_blocks=pool,
            lookahead_admission_steps=size.lookahead_steps if variant.get("lookahead") else 0,
            preemption_victim=variant.get("preemption_victim", "recency"),
        )
        runs.append(run_engine("lookahead", label, "mixed", llm, all_at_once(requests), setting.clock))
        del llm
    return runs


# ---- writing ---------------------------------------------------------------------------------

RUN_COLUMNS = (
    "experiment", "label", "x", "seconds", "requests", "output_tokens", "tokens_per_second", "latency_p50",
    "latency_p99", "ttft_p50", "ttft_p99", "utilisation", "prefill_tokens", "preemptions",
)


def run_row(run: Measured) -> dict[str, object]:
    return {
        "experiment": run.experiment, "label": run.label, "x": run.x, "seconds": round(run.seconds, 3),
        "requests": len(run.latencies), "output_tokens": run.output_tokens,
        "tokens_per_second": round(run.tokens_per_second, 2),
        "latency_p50": round(percentile(run.latencies, 50), 3), "latency_p99": round(percentile(run.latencies, 99), 3),
        "ttft_p50": round(percentile(run.ttfts, 50), 3), "ttft_p99": round(percentile(run.ttfts, 99), 3),
        "utilisation": round(run.utilisation, 3), "prefill_tokens": run.prefill_tokens, "preemptions": run.preemptions,
    }


def write_csvs(out: Path, runs: list[Measured]) -> None:
    with open(out / "runs.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=RUN_COLUMNS)
        writer.writeheader()
        writer.writerows(run_row(run) for run in runs)
    with open(out / "steps.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["experiment", "label", "x", "step", "time", "kv_blocks_used", "kv_blocks_total", "seats", "sampled"])
        for run in runs:
            for index, point in enumerate(run.steps):
                writer.writerow(
                    [run.experiment, run.label, run.x, index, round(point.time, 4), point.kv_blocks_used,
                     run.kv_blocks_total, run.seats, point.sampled]
                )


def table(runs: list[Measured], columns: tuple[str, ...]) -> str:
    rows = [run_row(run) for run in runs]
    return markdown_table(columns, [[row[c] for c in columns] for row in rows])


def find(runs: list[Measured], experiment: str, label: str, x: str | None = None) -> Measured:
    return next(r for r in runs if r.experiment == experiment and r.label == label and (x is None or r.x == x))


def gain(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline else "n/a"


def write_report(out: Path, setting: Setting, header: str, runs: list[Measured], ideal_prefill: int) -> None:
    spread = [r for r in runs if r.experiment == "spread"]
    continuous_vs = {
        x: (find(runs, "spread", "continuous", x).tokens_per_second, find(runs, "spread", "static", x).tokens_per_second,
            find(runs, "spread", "hf static", x).tokens_per_second)
        for x in SPREADS
    }
    arrival_order, prefix_aware = find(runs, "prefix", "arrival order"), find(runs, "prefix", "prefix-aware")
    lookahead = {label: find(runs, "lookahead", label) for label in LOOKAHEAD_VARIANTS}
    today = lookahead["today (recency victims)"]
    defaults = EngineConfig()
    size = setting.size
    lines = [
        "# Continuous batching, measured",
        "",
        header,
        "",
        f"Size `{next(name for name, s in SIZES.items() if s == size)}`: {size}.",
        "",
        "Every request is greedy with `ignore_eos`: every policy computes the same tokens, only the time differs.",
        "Utilisation is useful tokens per seat-step (seats = `max_num_seqs`, HF: the static batch size): 1.0 when",
        "every seat samples a wanted token every step. Latency and time to first token (TTFT) count from a",
        "request's arrival. The raw numbers are in `runs.csv` (one row per run) and `steps.csv` (one per step).",
        "",
        "## 1. Output-length spread, all requests at t=0",
        "",
        f"{size.requests} requests, prompts of {size.prompt_len[0]}-{size.prompt_len[1]} tokens, outputs of "
        f"{size.mean_output_len} tokens on average, {size.seats} seats.",
        "",
        "![throughput vs spread](throughput_vs_spread.png)",
        "",
        table(spread, ("label", "x", "seconds", "tokens_per_second", "latency_p50", "latency_p99", "ttft_p50", "utilisation")),
        "",
        markdown_table(
            ("spread", "continuous vs static", "continuous vs HF static", "static vs HF static"),
            [[x, gain(c, s), gain(c, h), gain(s, h)] for x, (c, s, h) in continuous_vs.items()],
        ),
        "",
        f"Seats and KV blocks in use over time, one run of each policy (spread: {TIMELINE_SPREAD}):",
        "",
        "![utilisation and KV occupancy over time](over_time.png)",
        "",
        "## 2. Poisson arrivals",
        "",
        f"{size.poisson_requests} requests (spread: {POLICY_SPREAD}) arriving at fractions "
        f"{size.arrival_fractions} of continuous batching's all-at-once capacity (x: requests/s).",
        "",
        "![latency vs arrival rate](latency_vs_rate.png)",
        "",
        table([r for r in runs if r.experiment == "arrival"],
              ("label", "x", "tokens_per_second", "latency_p50", "latency_p99", "ttft_p50", "ttft_p99", "utilisation")),
        "",
        "## 3. Prefill chunk: `max_num_batched_tokens`",
        "",
        "Continuous batching, all requests at t=0 (x: max_num_batched_tokens). A small chunk keeps decodes",
        "flowing while long prompts are computed; a large one computes prompts in fewer, fuller steps.",
        "",
        "![chunk size](chunk_size.png)",
        "",
        table([r for r in runs if r.experiment == "chunk"],
              ("x", "seconds", "tokens_per_second", "latency_p50", "ttft_p50", "ttft_p99", "utilisation")),
        "",
        "## 4. Prefix-aware ordering of a job",
        "",
        f"A shuffled job of {size.documents} documents x {size.questions} questions (document {size.document_len} "
        f"tokens, question {size.question_len}, answer {size.answer_len}); the KV pool holds {size.pool_documents} "
        f"whole prompts. Ideal prefill (each document once): {ideal_prefill} tokens.",
        "",
        table([arrival_order, prefix_aware], ("label", "seconds", "tokens_per_second", "prefill_tokens", "latency_p99")),
        "",
        f"Prefix-aware ordering computes **{gain(arrival_order.prefill_tokens, prefix_aware.prefill_tokens)} fewer "
        f"prefill tokens** than arrival order (target: >= 3x) and runs {gain(prefix_aware.tokens_per_second, arrival_order.tokens_per_second)} "
        f"as fast. Default: `prefix_aware_ordering={defaults.prefix_aware_ordering}`.",
        "",
        "## 5. Lookahead admission and least-work victims",
        "",
        f"{size.mixed_requests} requests, prompts of {size.mixed_prompt_len[0]}-{size.mixed_prompt_len[1]} tokens, "
        f"outputs of {size.mixed_output_len[0]}-{size.mixed_output_len[1]}, all at t=0, a KV pool of "
        f"{size.mixed_pool_fraction:.0%} of what {size.seats} seats of the longest request would need; lookahead "
        f"horizon {size.lookahead_steps} steps.",
        "",
        table(list(lookahead.values()),
              ("label", "seconds", "tokens_per_second", "latency_p50", "latency_p99", "ttft_p50", "preemptions", "prefill_tokens")),
        "",
        markdown_table(
            ("variant", "throughput vs today", "p99 latency vs today"),
            [[label, gain(run.tokens_per_second, today.tokens_per_second),
              gain(percentile(run.latencies, 99), percentile(today.latencies, 99))] for label, run in lookahead.items()],
        ),
        "",
        f"Defaults: `lookahead_admission_steps={defaults.lookahead_admission_steps}`, "
        f"`preemption_victim={defaults.preemption_victim!r}`.",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


def make_plots(out: Path, runs: list[Measured]) -> None:
    # matplotlib (a test extra) loads only here, so the `conveyor` command line works without it.
    from bench.report_plots import plot_chunk_sizes, plot_latency_vs_rate, plot_over_time, plot_throughput_vs_spread

    plot_throughput_vs_spread(out / "throughput_vs_spread.png", [r for r in runs if r.experiment == "spread"], SPREADS)
    plot_latency_vs_rate(out / "latency_vs_rate.png", [r for r in runs if r.experiment == "arrival"])
    plot_chunk_sizes(out / "chunk_size.png", [r for r in runs if r.experiment == "chunk"])
    timeline = [find(runs, "spread", policy, TIMELINE_SPREAD) for policy in ("static", "continuous")]
    plot_over_time(out / "over_time.png", timeline)


def run(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("the report's plots need matplotlib: pip install matplotlib (it is in the test extra)")
    if args.clock == "cpu":
        args.threads = 1  # CPU time sums all threads
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # Resolved once here: every run, and HF's, uses the dtype the header names.
    dtype = dtype_name(resolve_dtype(args.dtype, torch.device(args.device)))
    setting = Setting(args.model, dtype, args.device, SIZES[args.size], args.seed, args.clock)
    vocab_size = resolve_vocab_size(setting.model)
    header = (
        f"`python -m bench.report --out {out} --size {args.size} --clock {args.clock}` — model {args.model}, {dtype} on {args.device} "
        f"({describe_machine(args.device)}), {torch.get_num_threads()} torch threads, torch {torch.__version__}, seed {args.seed}."
    )
    print(header, flush=True)
    spread = report_progress(spread_experiment(setting, vocab_size))
    capacity = find(spread, "spread", "continuous", POLICY_SPREAD).requests_per_second
    arrival = report_progress(arrival_experiment(setting, vocab_size, capacity))
    chunk = report_progress(chunk_experiment(setting, vocab_size))
    prefix, ideal = prefix_experiment(setting, vocab_size)
    report_progress(prefix)
    lookahead = report_progress(lookahead_experiment(setting, vocab_size))
    runs = spread + arrival + chunk + prefix + lookahead
    write_csvs(out, runs)
    make_plots(out, runs)
    write_report(out, setting, header, runs, ideal)
    print(f"wrote {out / 'report.md'}")


def report_progress(runs: list[Measured]) -> list[Measured]:
    for run in runs:
        row = run_row(run)
        print(" ".join(f"{k}={row[k]}" for k in ("experiment", "label", "x", "seconds", "tokens_per_second", "prefill_tokens")), flush=True)
    return runs


def resolve_vocab_size(model: str) -> int:
    return int(resolve_model(model).hf_config["vocab_size"])


def describe_machine(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_report_arguments, run, argv)


if __name__ == "__main__":
    main()
