"""Offline throughput: conveyor vs Hugging Face transformers' static-batch `generate`, same run.

Workload: N requests with random prompt token ids, prompt and output lengths uniform in ranges,
`ignore_eos`, greedy, fixed seed. Both sides get the same requests, model, dtype and device. HF pads
each static batch to its longest prompt and runs until its longest output is done; only the tokens
each request asked for are counted, for both sides.

    python -m bench.throughput --num-requests 64 --prompt-len 32 512 --output-len 32 256
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bench.common import run_cli
from engine import LLM, SamplingParams
from engine.dtypes import resolve_dtype
from engine.model_registry import DEFAULT_MODEL, resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class BenchResult:
    name: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(
    num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    # Skip the low ids, where tokenizers keep their special tokens.
    return [
        BenchRequest(
            prompt_token_ids=[rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_len))],
            output_len=rng.randint(*output_len),
        )
        for _ in range(num_requests)
    ]


def run_conveyor(llm: LLM, requests: list[BenchRequest], after_step: Callable[[], None] | None = None) -> BenchResult:
    """All requests submitted at once, then the engine stepped until they finish. `after_step` runs after
    every step, inside the timed loop, for benchmarks that look at each step."""
    engine = llm.engine
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    for index, r in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"bench-{index}", r.prompt_token_ids, params)
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        if after_step is not None:
            after_step()
    seconds = time.perf_counter() - start
    assert produced == sum(r.output_len for r in requests), "conveyor stopped a request early"
    return BenchResult("conveyor", seconds, produced)


def run_hf_static(model: PreTrainedModel, requests: list[BenchRequest], batch_size: int) -> BenchResult:
    """Static batches on the model's device; only the requested tokens count."""
    model.generation_config.eos_token_id = None  # ignore_eos
    model.generation_config.pad_token_id = 0

    def generate(batch: list[BenchRequest], max_new_tokens: int) -> None:
        longest = max(len(r.prompt_token_ids) for r in batch)
        # Left padding, as decoder-only batched generation requires.
        ids = [[0] * (longest - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
        mask = [[0] * (longest - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch]
        with torch.inference_mode():
            model.generate(
                torch.tensor(ids, device=model.device),
                attention_mask=torch.tensor(mask, device=model.device),
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )

    generate(requests[:1], 2)  # warm-up, as conveyor gets
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        generate(batch, max(r.output_len for r in batch))
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    return BenchResult("hf static generate", seconds, sum(r.output_len for r in requests))


def format_table(results: list[BenchResult], baseline: BenchResult) -> str:
    lines = [f"{'engine':<22}{'seconds':>10}{'output tok':>12}{'tok/s':>10}{'vs HF':>8}", "-" * 62]
    for r in results:
        ratio = r.tokens_per_second / baseline.tokens_per_second
        lines.append(f"{r.name:<22}{r.seconds:>10.1f}{r.output_tokens:>12}{r.tokens_per_second:>10.1f}{ratio:>7.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=64, help="requests per HF static batch")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--skip-hf", action="store_true", help="only run conveyor")


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    llm = LLM(
        model=args.model, dtype=args.dtype, device=args.device,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
    )
    requests = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), llm.engine.model_config.vocab_size, args.seed
    )
    print(
        f"model={llm.model_name} dtype={args.dtype} device={args.device} requests={args.num_requests} "
        f"prompt={args.prompt_len[0]}-{args.prompt_len[1]} output={args.output_len[0]}-{args.output_len[1]} "
        f"threads={torch.get_num_threads()}",
        flush=True,
    )
    ours = run_conveyor(llm, requests)
    print(f"conveyor: {ours.tokens_per_second:.1f} output tok/s", flush=True)
    if args.skip_hf:
        return
    model_path = resolve_model(args.model).path
    del llm
    import transformers

    dtype = resolve_dtype(args.dtype, torch.device(args.device))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(args.device).eval()
    hf = run_hf_static(hf_model, requests, args.hf_batch_size)
    print(format_table([ours, hf], baseline=hf))


if __name__ == "__main__":
    main()
