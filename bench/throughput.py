"""Offline throughput: conveyor vs Hugging Face transformers' static-batch `generate`, same run.

Workload: N requests with random prompt token ids, prompt and output lengths uniform in ranges,
`ignore_eos`, greedy, fixed seed. Both sides get the same requests, model, dtype and device. HF pads
each static batch to its longest prompt and runs until its longest output is done; only the tokens
each request asked for are counted, for both sides.

It also prints the useful FLOP/s of each side against this machine's measured matmul peak (the
roofline) and, on CPU, a second, profiled conveyor pass over fresh prompts of the same shape (the
first pass's are in the prefix cache by then): where a step's time goes (matmuls, attention, other
model ops, sampling, scheduling, Python overhead; see bench/step_profile.py).

    python -m bench.throughput --num-requests 64 --prompt-len 32 512 --output-len 32 256

A named dummy shape (`--model gemma-2-9b`, see engine.model_registry.DUMMY_SHAPES) runs with random weights
on both sides (HF builds the same config with its own random weights); `--small` cuts it to a few narrow
layers of the same family (windows, soft-capping, norms, layer pattern kept), for CPU runs.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bench.common import dtype_name, run_cli
from bench.options import add_throughput_arguments
from bench.step_profile import StepProfile, matmul_peak_flops, useful_flops
from engine import LLM, SamplingParams
from engine.model_registry import DUMMY_SHAPES, resolve_model, transformers_source

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
    latencies: tuple[float, ...] = ()  # per request, seconds from the start to the end of its batch (HF only)

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


def run_hf_static(
    model: PreTrainedModel, requests: list[BenchRequest], batch_size: int, clock: Callable[[], float] = time.perf_counter
) -> BenchResult:
    """Static batches on the model's device; only the requested tokens count. `clock`: seconds, e.g.
    time.process_time to count CPU time on a shared machine."""
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
    latencies: list[float] = []
    start = clock()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        generate(batch, max(r.output_len for r in batch))
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        latencies += [clock() - start] * len(batch)
    seconds = clock() - start
    return BenchResult("hf static generate", seconds, sum(r.output_len for r in requests), tuple(latencies))


def format_table(results: list[BenchResult], baseline: BenchResult, flops: float, peak: float) -> str:
    """`flops`: the useful work of the run (the same for every engine); `peak`: the measured matmul FLOP/s."""
    header = f"{'engine':<22}{'seconds':>10}{'output tok':>12}{'tok/s':>10}{'vs HF':>8}{'GFLOP/s':>10}{'of peak':>9}"
    lines = [header, "-" * len(header)]
    for r in results:
        ratio = r.tokens_per_second / baseline.tokens_per_second
        achieved = flops / r.seconds
        lines.append(
            f"{r.name:<22}{r.seconds:>10.1f}{r.output_tokens:>12}{r.tokens_per_second:>10.1f}{ratio:>7.2f}x"
            f"{achieved / 1e9:>10.1f}{achieved / peak:>8.1%}"
        )
    return "\n".join(lines)


def format_profile(split: dict[str, float], steps: int) -> str:
    total = sum(split.values())
    lines = [f"{'per step':<18}{'ms':>8}{'share':>8}", "-" * 34]
    lines += [f"{name:<18}{1000 * seconds / steps:>8.2f}{seconds / total:>8.1%}" for name, seconds in split.items()]
    return "\n".join(lines)


def small_shape(config: dict) -> dict:
    """The shape cut to a few narrow layers: the family's structure (architecture, windows shrunk below the
    benchmark's prompts, one global layer per pattern, soft-capping, q/k norms, experts and top-k) kept, its
    size not."""
    pattern = config.get("sliding_window_pattern") or 2
    small = {**config, "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256,
             "num_hidden_layers": max(2, pattern), "num_attention_heads": 4,
             "num_key_value_heads": 4 if config["num_key_value_heads"] == config["num_attention_heads"] else 2,
             "head_dim": 32}
    # a mixture of experts keeps its expert count and top-k; its widths shrink with the dense one
    for width in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if config.get(width):
            small[width] = max(16, config[width] * small["intermediate_size"] // config["intermediate_size"])
    if config.get("mlp_only_layers"):
        small["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < small["num_hidden_layers"]]
    if config.get("query_pre_attn_scalar"):
        small["query_pre_attn_scalar"] = 32
    if config.get("sliding_window"):
        small["sliding_window"] = min(config["sliding_window"], 64)
    return small


def dummy_shape_folder(name: str, small: bool) -> Path:
    """A folder holding only the named shape's config.json, which both engines build random weights for."""
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    config = small_shape(DUMMY_SHAPES[name]) if small else DUMMY_SHAPES[name]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_throughput_arguments, run, argv)


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    dummy = args.model in DUMMY_SHAPES
    if args.small and not dummy:
        raise SystemExit(f"--small cuts a named dummy shape: {sorted(DUMMY_SHAPES)}")
    model = str(dummy_shape_folder(args.model, args.small)) if dummy else args.model
    llm = LLM(
        model=model, dtype=args.dtype, device=args.device, load_format="dummy" if dummy else "auto",
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    requests = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), llm.engine.model_config.vocab_size, args.seed
    )
    dtype = llm.engine.dtype  # what --dtype resolved to here
    print(
        f"model={args.model}{' (small)' if args.small else ''} dtype={dtype_name(dtype)} device={args.device} "
        f"requests={args.num_requests} "
        f"prompt={args.prompt_len[0]}-{args.prompt_len[1]} output={args.output_len[0]}-{args.output_len[1]} "
        f"threads={torch.get_num_threads()}",
        flush=True,
    )
    ours = run_conveyor(llm, requests)
    device = torch.device(args.device)
    peak = matmul_peak_flops(dtype, device)
    flops = useful_flops(llm.engine.model_config, [(len(r.prompt_token_ids), r.output_len) for r in requests])
    print(
        f"conveyor: {ours.tokens_per_second:.1f} output tok/s; useful work {flops / ours.seconds / 1e9:.1f} GFLOP/s "
        f"= {flops / ours.seconds / peak:.1%} of this machine's {dtype_name(dtype)} matmul peak "
        f"({peak / 1e9:.1f} GFLOP/s)",
        flush=True,
    )
    if not args.skip_profile and device.type == "cpu":
        profile = StepProfile(llm.engine)
        profile.attach()
        steps_before = llm.engine.counters.steps
        # Fresh prompts of the same shape: the timed pass's prompts are all in the prefix cache by now.
        run_conveyor(llm, make_workload(
            args.num_requests, tuple(args.prompt_len), tuple(args.output_len), llm.engine.model_config.vocab_size,
            args.seed + 1,
        ))
        print(format_profile(profile.split(), llm.engine.counters.steps - steps_before), flush=True)
    if args.skip_hf:
        return
    model_path = resolve_model(model, "dummy" if dummy else "auto").path
    del llm
    import transformers

    if dummy:
        hf_config = transformers.AutoConfig.from_pretrained(str(model_path))
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    else:
        path, arguments = transformers_source(model)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **arguments)
    hf_model = hf_model.to(args.device).eval()
    hf = run_hf_static(hf_model, requests, args.hf_batch_size)
    print(format_table([ours, hf], baseline=hf, flops=flops, peak=peak))


if __name__ == "__main__":
    main()
