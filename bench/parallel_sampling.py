"""Parallel sampling: KV blocks of n samples sharing their prompt vs n separate requests.

Workload: R requests with random prompt token ids of one length (default 512), each sampled n times
(default 8) at temperature 0.8 for a fixed number of tokens, `ignore_eos`, all submitted at t=0. Two
runs:

  shared    R requests with `n` samples: the prompt is computed once, and the samples fork from it
            sharing its blocks (copy-on-write), each holding only the blocks of its own tokens
  separate  R x n requests with n = 1: every copy of a prompt computes and holds its own blocks

Request r samples with base seed `seed + r * n`, and the engine seeds its sample i with base + i; the
separate request for sample i gets seed base + i, so both runs draw the same samples (checked).
Prefix caching is off in both runs (`--prefix-caching` turns it on in both), otherwise the separate
copies of a prompt would share its blocks through the cache and this would not measure forking.

KV blocks in use are read after every step: the peak, and the count right after the step that
finished computing every prompt (before any sample has written a block of its own).

    python -m bench.parallel_sampling --num-requests 4 --prompt-len 512 --output-len 64 --n 8
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

TARGET_BLOCK_REDUCTION = 3.0


def sampling_params(args: argparse.Namespace, n: int, seed: int) -> SamplingParams:
    return SamplingParams(n=n, temperature=args.temperature, seed=seed, max_tokens=args.output_len, ignore_eos=True)


def base_seed(args: argparse.Namespace, request_index: int) -> int:
    return args.seed + request_index * args.n


def shared_submissions(args: argparse.Namespace, requests: list[BenchRequest]) -> list[Submission]:
    return [
        Submission(str(r), req.prompt_token_ids, sampling_params(args, args.n, base_seed(args, r)))
        for r, req in enumerate(requests)
    ]


def separate_submissions(args: argparse.Namespace, requests: list[BenchRequest]) -> list[Submission]:
    return [
        Submission(f"{r}.{i}", req.prompt_token_ids, sampling_params(args, 1, base_seed(args, r) + i))
        for r, req in enumerate(requests)
        for i in range(args.n)
    ]


def blocks_after_prompts(run: Run, prompt_tokens: int) -> int:
    """KV blocks in use after the first step by which every prompt token had been computed."""
    return next(s.kv_blocks_used for s in run.steps if s.prompt_tokens_computed >= prompt_tokens)


def format_table(runs: list[Run], sequences: int, after_prompts: list[int], baseline: int) -> str:
    headers = [
        "run", "requests", "sequences", "KV blocks after prompts", "peak KV blocks", "wall s", "out tok/s",
        "peak blocks: separate / run", "after prompts: separate / run", "tok/s vs separate",
    ]
    separate, separate_after = runs[baseline], after_prompts[baseline]
    rows = [
        [
            r.name, len(r.outputs), sequences, after, r.peak_kv_blocks_used, f"{r.seconds:.1f}",
            f"{r.output_tokens_per_second:.1f}", ratio(separate.peak_kv_blocks_used, r.peak_kv_blocks_used),
            ratio(separate_after, after), ratio(r.output_tokens_per_second, separate.output_tokens_per_second),
        ]
        for r, after in zip(runs, after_prompts)
    ]
    return markdown_table(headers, rows)


def compare_samples(shared: Run, separate: Run, num_requests: int, n: int) -> str:
    differing = [
        f"{r}.{i}"
        for r in range(num_requests)
        for i in range(n)
        if shared.token_ids(str(r))[i] != separate.token_ids(f"{r}.{i}")[0]
    ]
    total = num_requests * n
    if not differing:
        return f"sampled tokens identical between the runs: yes ({total} of {total} samples)"
    return f"sampled tokens identical between the runs: NO, {len(differing)} of {total} differ ({', '.join(differing[:8])})"


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--prefix-caching", action="store_true", help="turn prefix caching on in both runs")


def run(args: argparse.Namespace) -> None:
    setup_torch(args)
    vocab_size = resolve_model(args.model).hf_config["vocab_size"]
    lengths = (args.prompt_len, args.prompt_len)
    requests = make_workload(args.num_requests, lengths, (args.output_len, args.output_len), vocab_size, args.seed)
    plans = [
        (f"shared (n={args.n})", shared_submissions(args, requests), args.num_requests * args.prompt_len),
        (f"separate ({args.n} x n=1)", separate_submissions(args, requests), args.num_requests * args.n * args.prompt_len),
    ]
    runs: list[Run] = []
    after_prompts: list[int] = []
    for name, submissions, prompt_tokens in plans:
        llm = load(args, enable_prefix_caching=args.prefix_caching)
        if not runs:
            print(
                describe(
                    args, llm, requests=args.num_requests, n=args.n, prompt=args.prompt_len, output=args.output_len,
                    temperature=args.temperature, prefix_caching="on" if args.prefix_caching else "off",
                ),
                flush=True,
            )
        runs.append(drive(name, llm, submissions))
        after_prompts.append(blocks_after_prompts(runs[-1], prompt_tokens))
        print(f"{name}: {runs[-1].seconds:.1f} s", flush=True)
        del llm
    shared, separate = runs
    print()
    print(format_table(runs, args.num_requests * args.n, after_prompts, baseline=1))
    print()
    print(compare_samples(shared, separate, args.num_requests, args.n))
    reduction = separate.peak_kv_blocks_used / shared.peak_kv_blocks_used
    verdict = "met" if reduction >= TARGET_BLOCK_REDUCTION else "NOT met"
    print(
        f"peak KV blocks, separate / shared at prompt {args.prompt_len}: {reduction:.2f}x "
        f"(target >= {TARGET_BLOCK_REDUCTION:g}x): {verdict}"
    )


if __name__ == "__main__":
    main()
