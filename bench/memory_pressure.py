"""Preemption under KV-cache pressure: swap vs recompute vs a batch too small to ever need preemption.

Workload: N requests with random prompt token ids, prompt and output lengths uniform in ranges,
`ignore_eos`, greedy, fixed seed (as bench/throughput.py), all submitted at t=0. The KV pool is sized
to a fraction (default a quarter) of the blocks the whole workload would hold if every request ran
at once, sum of ceil((prompt + output) / block_size). Three runs on that same pool, prefix caching
off so only preemption differs:

  swap         preempted sequences park their blocks in the host pool and come back whole
  recompute    preempted sequences drop their blocks and recompute them when readmitted
  no preempt   max_num_seqs = pool // (largest request's blocks): whatever is admitted always fits,
               so nothing is ever preempted, at the cost of a smaller batch

Latency is from submission to the end of the step that returned the request's final output. Ratios
are against the recompute run: for tok/s higher is better, for latency lower is better.

    python -m bench.memory_pressure --num-requests 48 --prompt-len 64 256 --output-len 64 192
"""

from __future__ import annotations

import argparse

from bench.common import (
    Run,
    Submission,
    add_model_arguments,
    describe,
    drive,
    load,
    markdown_table,
    ratio,
    run_cli,
    setup_torch,
)
from bench.throughput import BenchRequest, make_workload
from engine import SamplingParams
from engine.model_registry import resolve_model


def blocks_needed(request: BenchRequest, block_size: int) -> int:
    return -(-(len(request.prompt_token_ids) + request.output_len) // block_size)


def submissions(requests: list[BenchRequest]) -> list[Submission]:
    return [
        Submission(str(i), r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
        for i, r in enumerate(requests)
    ]


def run_configs(pool: int, no_preempt_seqs: int) -> list[tuple[str, dict[str, object]]]:
    common: dict[str, object] = {"num_kv_blocks": pool, "enable_prefix_caching": False}
    return [
        ("swap", {**common, "preemption_mode": "swap"}),
        ("recompute", {**common, "preemption_mode": "recompute"}),
        (f"no preempt (max-num-seqs={no_preempt_seqs})", {**common, "max_num_seqs": no_preempt_seqs}),
    ]


def format_table(runs: list[Run], max_seqs: list[int], baseline: Run) -> str:
    headers = [
        "run", "max seqs", "wall s", "out tok/s", "p50 lat s", "p95 lat s", "preempt swap", "preempt recompute",
        "blocks swapped out/in", "prompt tok computed", "positions computed",
        "tok/s vs recompute", "p50 vs recompute", "p95 vs recompute",
    ]
    rows = [
        [
            r.name, seqs, f"{r.seconds:.1f}", f"{r.output_tokens_per_second:.1f}",
            f"{r.latency_percentile(50):.1f}", f"{r.latency_percentile(95):.1f}",
            r.preemptions("swap"), r.preemptions("recompute"), f"{r.blocks_swapped_out}/{r.blocks_swapped_in}",
            r.prompt_tokens_computed, r.positions_computed,
            ratio(r.output_tokens_per_second, baseline.output_tokens_per_second),
            ratio(r.latency_percentile(50), baseline.latency_percentile(50)),
            ratio(r.latency_percentile(95), baseline.latency_percentile(95)),
        ]
        for r, seqs in zip(runs, max_seqs)
    ]
    return markdown_table(headers, rows)


def compare_outputs(runs: list[Run], reference: Run) -> str:
    """Greedy decoding should not depend on how a sequence was preempted or batched. In bfloat16 it can:
    a recomputed sequence runs its generated tokens through the prefill path, whose rounding differs
    from the decode kernel's, and a near-tie between two tokens may flip (float32 agrees exactly)."""
    request_ids = sorted(reference.outputs, key=int)
    parts = []
    for r in runs:
        if r is reference:
            continue
        diverged = [_first_difference(r.token_ids(rid)[0], reference.token_ids(rid)[0]) for rid in request_ids]
        positions = sorted(p for p in diverged if p is not None)
        if positions:
            shown = ", ".join(map(str, positions[:8])) + (", ..." if len(positions) > 8 else "")
            parts.append(f"{r.name}: {len(positions)} of {len(request_ids)} differ (from output token {shown})")
        else:
            parts.append(f"{r.name}: identical ({len(request_ids)} of {len(request_ids)})")
    return f"greedy outputs vs {reference.name}: " + "; ".join(parts)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    mismatch = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if mismatch is None and len(a) != len(b):
        return min(len(a), len(b))
    return mismatch


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 192), metavar=("MIN", "MAX"))
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="KV pool / blocks the workload needs at once")


def run(args: argparse.Namespace) -> None:
    setup_torch(args)
    vocab_size = resolve_model(args.model).hf_config["vocab_size"]
    requests = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size, args.seed)
    per_request = [blocks_needed(r, args.block_size) for r in requests]
    pool = int(sum(per_request) * args.pool_fraction)
    if pool < max(per_request):
        raise SystemExit(f"a pool of {pool} blocks cannot hold the largest request ({max(per_request)} blocks)")
    no_preempt_seqs = pool // max(per_request)

    runs: list[Run] = []
    max_seqs: list[int] = []
    for index, (name, options) in enumerate(run_configs(pool, no_preempt_seqs)):
        llm = load(args, **options)
        if index == 0:
            print(
                describe(
                    args, llm, requests=args.num_requests, prompt=f"{args.prompt_len[0]}-{args.prompt_len[1]}",
                    output=f"{args.output_len[0]}-{args.output_len[1]}", block_size=args.block_size,
                ),
                flush=True,
            )
            print(
                f"KV blocks if all ran at once: {sum(per_request)}; pool: {pool} ({args.pool_fraction:g} of that); "
                f"largest request: {max(per_request)} blocks; prefix caching off",
                flush=True,
            )
        runs.append(drive(name, llm, submissions(requests)))
        assert runs[-1].output_tokens == sum(r.output_len for r in requests), f"{name} stopped a request early"
        max_seqs.append(llm.engine.config.max_num_seqs)
        print(f"{name}: {runs[-1].seconds:.1f} s", flush=True)
        del llm
    print()
    print(format_table(runs, max_seqs, baseline=runs[1]))
    print()
    print(compare_outputs(runs, reference=runs[2]))


if __name__ == "__main__":
    main()
