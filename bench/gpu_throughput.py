"""GPU throughput: conveyor vs Hugging Face transformers' static-batch `generate` and continuous-batching
`generate_batch`, in one run on one device, and how close decode comes to the memory-bandwidth floor.

Workload (the one nano-vllm's and vLLM's comparisons use): 256 requests, prompt and output lengths
uniform in 100-1024 tokens, random prompt token ids, ignore_eos, greedy, seed 0; the Qwen3-0.6B and
Llama-3-8B shapes with random weights (conveyor's load_format="dummy"; HF builds the same config with
its own random init: with ignore_eos the weights do not change the speed), bfloat16.

- HF static generate: left-padded batches of --hf-batch-size, each run to its longest requested output.
- HF generate_batch: transformers' continuous batching, driven through the manager that `generate_batch`
  wraps so that each request gets its own max_new_tokens (`generate_batch` takes one for all).
- Only the requested tokens count, on every side. HF runs on the first --hf-max-requests requests
  (default: all; 128 for llama-3-8b); its tok/s, and the ratios, are then over that subset.
- Bandwidth floor of a decode step (every scheduled sequence computes one token): the bytes it must
  read (every weight but an untied input embedding, of which it reads only its batch's rows; the K/V
  of every scheduled context) at the bandwidth of a 1 GiB device-to-device copy (bytes read + written
  / time). Step times are the engine's own, host work included.
- Decode attention kernel: conveyor_kernels.decode_attention over random paged caches with Llama-3-8B's heads
  at 8k-32k contexts; K/V bytes read / kernel time, against the same copy bandwidth.
- HF's attention implementation is pinned (--hf-attention, default sdpa; eager runs as paged|eager under
  continuous batching) and generate_batch may not switch to a flash kernel that happens to be installed;
  each table says which implementation ran.

Each command below fits well inside the 10 minutes a lent GPU allows one command; each prints its
H100 estimate first (a roofline: bytes at HBM bandwidth, prefill FLOPs at peak, plus HF's eager
per-layer launch cost and the builds):

    python -m bench.gpu_throughput --kernels             # the decode attention kernel alone
    python -m bench.gpu_throughput --models qwen3-0.6b   # one model: conveyor and both HF baselines
    python -m bench.gpu_throughput --models llama-3-8b
    python -m bench.gpu_throughput                       # all of the above in one command (no time limit)
    python -m bench.gpu_throughput --smoke               # tiny shapes on the CPU, end to end in seconds
    python -m bench.gpu_throughput --models llama-3-8b --kernels --out results/   # both, one process

With --out, results.json and results.md are written as each figure comes, so a run stopped midway keeps what
it measured. A side that fails (an HF API this transformers lacks) is recorded with its error and the run goes
on; the command then exits non-zero. Options of HF's continuous batching that the installed transformers does
not have (5.17: `auto_switch_to_flash`) are left out and named in the table; transformers 5.17-5.24 run.
bench/device_check.sh runs this on a lent GPU beside the CUDA tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.common import dtype_name, markdown_table, run_cli
from bench.throughput import BenchRequest, BenchResult, make_workload, run_conveyor, run_hf_static
from engine import LLM
from engine.config import ModelConfig
from engine.dtypes import resolve_dtype
from engine.kv_cache import bytes_per_block
from engine.llm_engine import LLMEngine
from engine.model_registry import DUMMY_SHAPES, resolve_model
from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MODELS = ("qwen3-0.6b", "llama-3-8b")
# Chosen by the estimate below (`estimate_seconds`), not yet measured: HF's eager decode steps dominate, so
# Llama-3-8B's HF runs take the first 128 requests (two static batches of 64).
HF_MAX_REQUESTS = {"llama-3-8b": 128}
HF_ATTENTION = ("sdpa", "eager")
COMMAND_LIMIT_SECONDS = 600  # what a lent GPU allows one command
# The H100 SXM's roofline, for the estimate: HBM3 bandwidth and dense bf16 tensor-core throughput.
H100_BANDWIDTH = 3.35e12  # bytes/s
H100_BF16_FLOPS = 989e12
# Not a roofline term: an eager HF decoder layer launches ~25 kernels from Python per step (~0.8 ms),
# which is what makes its decode steps 25-40 ms on Llama-3-8B at batch 64.
HF_SECONDS_PER_LAYER_STEP = 0.8e-3
CONVEYOR_FLOOR_FACTOR = 1.5  # conveyor's decode steps are budgeted at its target: within 1.5x of the floor
BUILD_SECONDS = 60.0  # per model: conveyor's warm-up compiles and graph capture, HF's init on the GPU
KERNEL_COMMAND_SECONDS = 60.0  # --kernels: ~10 compiles and 9 timed shapes of a few hundred ms each
# Options left off the command line; --smoke swaps in tiny shapes on the CPU.
FULL_DEFAULTS: dict[str, Any] = {
    "device": "cuda", "num_requests": 256, "prompt_len": [100, 1024], "output_len": [100, 1024], "hf_batch_size": 64,
}
SMOKE_DEFAULTS: dict[str, Any] = {
    "device": "cpu", "num_requests": 8, "prompt_len": [8, 48], "output_len": [4, 24], "hf_batch_size": 4,
    "hf_max_requests": 6,
}
SMOKE_SHAPES: dict[str, dict[str, Any]] = {
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "eos_token_id": 2,
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "eos_token_id": 2,
    },
}
STEP_TARGET_MODEL = "llama-3-8b"
STEP_TARGET_BATCH = 128
RATIO_TARGETS = {"hf static generate": 5.0, "hf generate_batch": 3.0}  # conveyor tok/s over each HF side's
STEP_TARGET = 1 / 1.5  # floor / step time: the step within 1.5x of the floor
KERNEL_TARGET = 0.70  # of the copy bandwidth
KERNEL_GRID = ((1, 4, 16), (8192, 16384, 32768))  # batches, contexts
SMOKE_KERNEL_GRID = ((1, 2), (64, 128))
# --smoke times each kernel shape once after its warm-up: under Triton's interpreter a call takes 0.1-0.8 s on a
# small CPU, and a smoke run's figures are not GPU figures (it proves the part runs and prints its table).
SMOKE_KERNEL_REPEATS = 1
KERNEL_REPEATS = 5


@dataclass(frozen=True)
class DecodeStep:
    batch: int
    seconds: float
    floor_seconds: float  # the bytes the step must read, at the copy bandwidth

    @property
    def floor_fraction(self) -> float:
        return self.floor_seconds / self.seconds


@dataclass(frozen=True)
class ModelReport:
    label: str
    num_requests: int
    hf_requests: int
    results: list[BenchResult]  # conveyor first; an HF side that failed is missing
    decode_steps: list[DecodeStep]
    hf_attention: dict[str, str]  # HF side -> the attention implementation it ran with
    failures: dict[str, str] = field(default_factory=dict)  # HF side -> the error it stopped on
    hf_options_left_out: list[str] = field(default_factory=list)  # continuous-batching options this transformers lacks

    def ratio(self, hf_name: str) -> float | None:
        """conveyor tok/s over this HF side's; None where the side failed."""
        conveyor, hf = self.results[0], next((r for r in self.results if r.name == hf_name), None)
        return None if hf is None else conveyor.tokens_per_second / hf.tokens_per_second


@dataclass(frozen=True)
class KernelRun:
    batch: int
    context: int
    seconds: float
    bytes_read: int  # K and V of every context

    def fraction(self, bandwidth: float) -> float:
        return self.bytes_read / self.seconds / bandwidth


class DecodeStepRecorder:
    """Times the engine's decode-only steps (every sequence computes one token, no block crosses to or from
    the host pool) against their bandwidth floor, from the engine's own per-step counters."""

    def __init__(self, engine: LLMEngine, bandwidth: float) -> None:
        config = engine.model_config
        element_size = torch.tensor([], dtype=engine.dtype).element_size()
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        if not config.tie_word_embeddings:  # an untied input embedding is read a row per sequence, not whole
            weights -= config.vocab_size * config.hidden_size * element_size
        self.weight_bytes = weights
        self.kv_bytes_per_token = bytes_per_block(config, 1, engine.dtype)
        self.bandwidth = bandwidth
        self.steps: list[DecodeStep] = []
        self._engine = engine
        self._seen_steps = engine.counters.steps
        self._blocks_swapped = self._swapped_so_far()

    def _swapped_so_far(self) -> int:
        counters = self._engine.scheduler.counters
        return counters.blocks_swapped_out + counters.blocks_swapped_in

    def after_step(self) -> None:
        counters = self._engine.counters
        stepped, self._seen_steps = counters.steps != self._seen_steps, counters.steps
        swapped, self._blocks_swapped = self._blocks_swapped, self._swapped_so_far()
        # Steps that move blocks to or from the host pool spend part of their time on PCIe.
        if not stepped or swapped != self._blocks_swapped or counters.last_step_tokens != counters.last_step_sequences:
            return
        floor_bytes = self.weight_bytes + counters.last_step_context_tokens * self.kv_bytes_per_token
        self.steps.append(DecodeStep(counters.last_step_sequences, counters.last_step_seconds, floor_bytes / self.bandwidth))


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = KERNEL_REPEATS) -> float:
    """Median time of one call. On CUDA from CUDA events, by Triton's do_bench, which also flushes the L2
    cache before each call (one sequence's 8k-token context would otherwise sit in it); elsewhere wall time,
    of `repeats` calls after a warm-up."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median") / 1000
    fn()  # warm-up: first-touch page faults, the interpreter's first pass
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy, the bytes read and the bytes written both counted.
    1 GiB on a GPU (far past its L2); 64 MiB elsewhere (past a CPU's caches, quick to time)."""
    nbytes = 1024**3 if device.type == "cuda" else 64 * 1024**2
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * nbytes / median_seconds(lambda: target.copy_(source), device)


def bench_decode_attention(
    shape: ModelConfig, batch: int, context: int, dtype: torch.dtype, device: torch.device, block_size: int = 16,
    repeats: int = KERNEL_REPEATS,
) -> KernelRun:
    from conveyor_kernels.decode_attention import decode_attention

    blocks_per_seq = -(-context // block_size)
    cache_shape = (batch * blocks_per_seq, block_size, shape.num_key_value_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    # Blocks scattered over the pool, as a long-running engine's tables are.
    block_tables = torch.randperm(cache_shape[0], device=device).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, shape.num_attention_heads, shape.head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)

    def attend() -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, shape.head_dim**-0.5, out=out)

    seconds = median_seconds(attend, device, repeats)
    kv_bytes = 2 * batch * context * shape.num_key_value_heads * shape.head_dim * k_cache.element_size()
    return KernelRun(batch, context, seconds, kv_bytes)


def build_hf_model(
    hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device, attention: str
) -> PreTrainedModel:
    """The same config.json, with transformers' own random init, on the device, with the attention
    implementation named (HF's default picks one from what is installed)."""
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    # Initialised on the device itself: initialising 8B parameters on the CPU takes minutes.
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    return model.eval()


def run_hf_generate_batch(model: PreTrainedModel, requests: list[BenchRequest]) -> tuple[BenchResult, str, list[str]]:
    """transformers' continuous batching with eos disabled, each request to its own length, on the
    model's attention implementation (not switched to a flash kernel that happens to be installed,
    where this transformers has the option). Returns the result, the implementation that ran, and the
    options this transformers does not have, which were left out."""
    import transformers

    if not hasattr(model, "continuous_batching_context_manager"):
        raise RuntimeError(f"transformers {transformers.__version__} has no continuous batching (generate_batch)")
    longest_output = max(r.output_len for r in requests)
    # eos_token_id=-1 is the manager's "no eos".
    generation_config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=longest_output, eos_token_id=-1, pad_token_id=0
    )
    cache_options: dict[str, Any] = {"auto_switch_to_flash": False}
    if model.device.type != "cuda":
        # HF sizes its KV cache from free memory; on the CPU that is 60% of RAM, allocated at start
        # (seconds). Sized to the workload instead, in HF's default 256-token blocks.
        tokens = sum(len(r.prompt_token_ids) + r.output_len for r in requests)
        cache_options |= {"num_blocks": -(-tokens // 256) + len(requests), "max_batch_tokens": 256}
    config_fields = dataclasses_fields(transformers.ContinuousBatchingConfig)
    cache_options, left_out = supported_options(cache_options, config_fields)
    manager_options: dict[str, Any] = {
        "generation_config": generation_config,
        "continuous_batching_config": transformers.ContinuousBatchingConfig(**cache_options),
        "block": True,
    }
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        manager_options["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
            max_generated_length=longest_output,
            num_requests=len(requests),
        )
    except ImportError:
        left_out.append("workload_hints")
    accepted = inspect.signature(model.continuous_batching_context_manager).parameters
    manager_options, also_left_out = supported_options(manager_options, accepted)
    left_out += also_left_out
    with model.continuous_batching_context_manager(**manager_options) as manager:
        attention = model.config._attn_implementation  # what the manager runs ("eager" becomes "paged|eager")
        _run_to_completion(manager, [BenchRequest([1, 2, 3], 2)], "warm-up")
        start = time.perf_counter()
        produced = _run_to_completion(manager, requests, "bench")
        seconds = time.perf_counter() - start
    assert produced == sum(r.output_len for r in requests), "HF generate_batch stopped a request early"
    return BenchResult("hf generate_batch", seconds, produced), attention, sorted(left_out)


def supported_options(options: dict[str, Any], accepted: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """The options a transformers API of the installed version accepts, and the names of those it does not
    (transformers 5.17's ContinuousBatchingConfig has no `auto_switch_to_flash`, 5.24's has)."""
    names = set(accepted)
    return {k: v for k, v in options.items() if k in names}, [k for k in options if k not in names]


def dataclasses_fields(cls: type) -> list[str]:
    return [field.name for field in dataclasses.fields(cls)]


def _run_to_completion(manager: Any, requests: list[BenchRequest], prefix: str) -> int:
    """Submit, wait for every result, and return the tokens generated."""
    for index, r in enumerate(requests):
        manager.add_request(
            r.prompt_token_ids, request_id=f"{prefix}-{index}", max_new_tokens=r.output_len, eos_token_id=-1
        )
    produced, finished = 0, 0
    while finished < len(requests):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("HF's continuous-batching thread stopped before every request finished")
            continue
        if result.error is not None:
            raise RuntimeError(f"HF continuous batching failed request {result.request_id}: {result.error}")
        if result.is_finished():
            produced += len(result.generated_tokens)
            finished += 1
    return produced


def bench_model(
    model: str, args: argparse.Namespace, device: torch.device, bandwidth: float, results: ResultsFolder
) -> ModelReport:
    """conveyor, then HF static generate, then HF generate_batch; each side's figures written as soon as it
    finishes. An HF side that fails is recorded with its error and the next one runs."""
    label = model if model in DUMMY_SHAPES else Path(model).name
    print(f"{label}: conveyor ...", flush=True)
    llm = LLM(
        model=model, load_format="dummy", dtype=args.dtype, device=device, kernel_backend=args.kernel_backend,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
    )
    dtype = llm.engine.dtype
    requests = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), llm.engine.model_config.vocab_size, args.seed
    )
    recorder = DecodeStepRecorder(llm.engine, bandwidth)
    conveyor = run_conveyor(llm, requests, recorder.after_step)
    steps = recorder.steps
    del llm, recorder
    release_memory(device)
    results.record(("models", label, "requests"), len(requests))
    results.record(("models", label, "dtype"), dtype_name(dtype))
    results.record(("models", label, "sides", conveyor.name), result_figures(conveyor))
    results.record(("models", label, "decode_steps"), {name: step_figures(s) for name, s in _step_sets(steps)})

    cap = args.hf_max_requests if args.hf_max_requests is not None else HF_MAX_REQUESTS.get(model, len(requests))
    hf_requests = requests[: min(cap, len(requests))]
    results.record(("models", label, "hf_requests"), len(hf_requests))
    if len(hf_requests) < len(requests):
        print(f"{label}: HF runs capped at the first {len(hf_requests)} of {len(requests)} requests", flush=True)
    sides, attention, failures, left_out = [conveyor], {}, {}, []
    hf_model = None
    try:
        print(f"{label}: HF static generate ...", flush=True)
        hf_model = build_hf_model(resolve_model(model, "dummy").hf_config, dtype, device, args.hf_attention)
        attention["hf static generate"] = hf_model.config._attn_implementation
        sides.append(run_hf_static(hf_model, hf_requests, args.hf_batch_size))
    except Exception as error:  # recorded: the table and the JSON name the side that failed and why
        failures["hf static generate"] = _failure(label, "hf static generate", error)
    release_memory(device)
    if hf_model is not None:
        try:
            print(f"{label}: HF generate_batch ...", flush=True)
            continuous, attention["hf generate_batch"], left_out = run_hf_generate_batch(hf_model, hf_requests)
            sides.append(continuous)
        except Exception as error:
            failures["hf generate_batch"] = _failure(label, "hf generate_batch", error)
    del hf_model
    release_memory(device)
    for side in sides[1:]:
        results.record(("models", label, "sides", side.name), result_figures(side))
    for name, error in failures.items():
        results.record(("models", label, "sides", name), {"error": error})
    results.record(("models", label, "hf_attention"), attention)
    results.record(("models", label, "hf_options_left_out"), left_out)
    report = ModelReport(label, len(requests), len(hf_requests), sides, steps, attention, failures, left_out)
    results.record(("models", label, "conveyor_over"), {name: report.ratio(name) for name in RATIO_TARGETS})
    return report


def _failure(label: str, side: str, error: Exception) -> str:
    print(f"{label}: {side} failed:", flush=True)
    traceback.print_exc()
    return f"{type(error).__name__}: {error}"


def result_figures(result: BenchResult) -> dict[str, float]:
    return {
        "seconds": result.seconds, "output_tokens": result.output_tokens, "tokens_per_second": result.tokens_per_second
    }


def step_figures(steps: list[DecodeStep]) -> dict[str, float] | None:
    if not steps:
        return None
    return {
        "steps": len(steps),
        "median_batch": statistics.median(s.batch for s in steps),
        "median_step_seconds": statistics.median(s.seconds for s in steps),
        "median_floor_seconds": statistics.median(s.floor_seconds for s in steps),
        "median_floor_over_step": statistics.median(s.floor_fraction for s in steps),
    }


class ResultsFolder:
    """Figures written as soon as they are measured, so that a run stopped midway (a lent GPU's time limit, a
    crash) keeps what came before: results.json, rewritten whole after every figure, and results.md, each table
    appended as it is printed. Without a folder (no --out) they are only printed."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.data: dict[str, Any] = {}
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "results.md").write_text("")

    def record(self, path: tuple[str, ...], value: object) -> None:
        node = self.data
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        if self.folder is not None:
            partial = self.folder / "results.json.partial"  # replaced in one step: never half a file
            partial.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
            partial.replace(self.folder / "results.json")

    def table(self, text: str) -> None:
        print("\n" + text + "\n", flush=True)
        if self.folder is not None:
            with (self.folder / "results.md").open("a") as markdown:
                markdown.write(text + "\n\n")


def release_memory(device: torch.device) -> None:
    """What the run before left behind (an engine's KV pool, HF's caches), freed for the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_model(report: ModelReport, args: argparse.Namespace) -> str:
    conveyor = report.results[0]
    rows = []
    for r in report.results:
        requests = report.num_requests if r is conveyor else report.hf_requests
        name = f"{r.name} (batch {args.hf_batch_size})" if r.name == "hf static generate" else r.name
        ratio = conveyor.tokens_per_second / r.tokens_per_second
        rows.append(
            [name, requests, f"{r.seconds:.2f}", f"{r.output_tokens:,}", f"{r.tokens_per_second:,.1f}", f"{ratio:.2f}x"]
        )
    lines = [
        f"### {report.label}: {report.num_requests} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]}, "
        f"output {args.output_len[0]}-{args.output_len[1]} tokens, ignore_eos, greedy, seed {args.seed}",
        "",
        markdown_table(["engine", "requests", "seconds", "output tokens", "tok/s", "conveyor / this"], rows),
    ]
    if report.hf_requests < report.num_requests:
        lines.append(f"HF ran the first {report.hf_requests} requests only (--hf-max-requests); ratios compare tok/s.")
    for name, error in report.failures.items():
        lines.append(f"{name} FAILED: {error}")
    ran = "; ".join(f"{name}: {implementation}" for name, implementation in report.hf_attention.items())
    lines += [
        "HF generate_batch: its continuous-batching manager, one max_new_tokens per request.",
        f"HF attention implementation that ran: {ran} (asked for {args.hf_attention}).",
    ]
    if report.hf_options_left_out:
        lines.append(f"Left out, this transformers does not have them: {', '.join(report.hf_options_left_out)}.")
    lines += [
        "",
        markdown_table(
            ["decode-only steps", "steps", "median batch", "median step ms", "median floor ms", "median floor / step"],
            [_step_row(name, steps) for name, steps in _step_sets(report.decode_steps)],
        ),
    ]
    return "\n".join(lines)


def _large(steps: list[DecodeStep]) -> list[DecodeStep]:
    return [s for s in steps if s.batch >= STEP_TARGET_BATCH]


def _step_sets(steps: list[DecodeStep]) -> list[tuple[str, list[DecodeStep]]]:
    return [("all", steps), (f"batch >= {STEP_TARGET_BATCH}", _large(steps))]


def _step_row(name: str, steps: list[DecodeStep]) -> list[object]:
    figures = step_figures(steps)
    if figures is None:
        return [name, 0, "-", "-", "-", "-"]
    return [
        name,
        figures["steps"],
        figures["median_batch"],
        f"{figures['median_step_seconds'] * 1e3:.2f}",
        f"{figures['median_floor_seconds'] * 1e3:.2f}",
        f"{figures['median_floor_over_step']:.2f}",
    ]


def format_kernel(runs: list[KernelRun], shape: ModelConfig, bandwidth: float) -> str:
    rows = [
        [r.batch, r.context, f"{r.seconds * 1e6:.1f}", f"{r.bytes_read / 1e6:,.2f}",
         f"{r.bytes_read / r.seconds / 1e9:,.1f}", f"{r.fraction(bandwidth):.0%}"]
        for r in runs
    ]
    return "\n".join([
        f"### decode attention kernel: {shape.num_attention_heads} q heads, {shape.num_key_value_heads} kv heads, "
        f"head_dim {shape.head_dim}, block_size 16, random paged caches",
        "",
        markdown_table(["batch", "context", "us", "K/V MB read", "GB/s", "of copy bandwidth"], rows),
    ])


def format_summary(
    reports: list[ModelReport], kernel_runs: list[KernelRun] | None, bandwidth: float, smoke: bool
) -> str:
    rows: list[list[object]] = []
    for report in reports:
        for hf_name, target in RATIO_TARGETS.items():
            ratio = report.ratio(hf_name)
            label = f"{report.label}: conveyor / {hf_name} >= {target:g}x"
            if ratio is None:
                rows.append([label, f"not measured: {hf_name} failed", "n/a"])
            else:
                rows.append([label, f"{ratio:.2f}x", _met(ratio >= target)])
    step_target = f"{STEP_TARGET_MODEL}: decode step at batch >= {STEP_TARGET_BATCH} within 1.5x of the floor"
    step_report = next((r for r in reports if r.label == STEP_TARGET_MODEL), None)
    if step_report is None:
        rows.append([step_target, f"not run (python -m bench.gpu_throughput --models {STEP_TARGET_MODEL})", "n/a"])
    elif not _large(step_report.decode_steps):
        rows.append([step_target, f"no decode step reached batch {STEP_TARGET_BATCH}", "n/a"])
    else:
        fraction = statistics.median(s.floor_fraction for s in _large(step_report.decode_steps))
        rows.append([step_target, f"median floor / step {fraction:.2f} (target >= {STEP_TARGET:.2f})",
                     _met(fraction >= STEP_TARGET)])
    kernel_target = f"decode attention kernel >= {KERNEL_TARGET:.0%} of copy bandwidth"
    if kernel_runs is None:
        rows.append([kernel_target, "not run (python -m bench.gpu_throughput --kernels)", "n/a"])
    else:
        fractions = [r.fraction(bandwidth) for r in kernel_runs]
        met = sum(f >= KERNEL_TARGET for f in fractions)
        measured = f"{min(fractions):.0%} to {max(fractions):.0%}; met by {met} of {len(fractions)} shapes"
        rows.append([kernel_target, measured, _met(met == len(fractions))])
    what = "smoke run: tiny shapes on the CPU, not GPU figures; " if smoke else ""
    heading = f"### summary ({what}copy bandwidth {bandwidth / 1e9:,.1f} GB/s)"
    return "\n".join([heading, "", markdown_table(["target", "measured", "met"], rows)])


def _met(ok: bool) -> str:
    return "yes" if ok else "no"


def write_smoke_models(folder: Path) -> dict[str, str]:
    """Config-only folders, which conveyor loads with load_format="dummy", by shape name."""
    paths = {}
    for name, config in SMOKE_SHAPES.items():
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(config))
        paths[name] = str(folder / name)
    return paths


def describe_device(device: torch.device) -> str:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    return f"{name}; torch {torch.__version__}, transformers {transformers.__version__}"


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few short requests, on the CPU")
    parser.add_argument(
        "--models", nargs="+",
        help=f"these models (named dummy shapes or config.json folders), and the kernel only with --kernels "
        f"(default: {' '.join(MODELS)}, then the kernel)",
    )
    parser.add_argument(
        "--kernels", action="store_true", help="the decode attention kernel: alone, or after --models' models"
    )
    parser.add_argument(
        "--out", type=Path,
        help="folder for results.json and results.md, written as each figure comes (a stopped run keeps them)",
    )
    parser.add_argument(
        "--hf-attention", choices=HF_ATTENTION, default="sdpa", help="HF's attention implementation (default sdpa)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", help=f"default: {FULL_DEFAULTS['device']}; --smoke: {SMOKE_DEFAULTS['device']}")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, help="requests per HF static batch (default 64)")
    parser.add_argument(
        "--hf-max-requests", type=int,
        help=f"HF runs only the first N requests (default: all; per model: {HF_MAX_REQUESTS})",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--kernel-backend", choices=("auto", "torch", "triton"), default="auto",
        help="conveyor's kernels (default auto: Triton on CUDA); triton on the CPU, under TRITON_INTERPRET=1, runs "
        "the GPU path's kernels (bench/device_check.sh --dry-run)",
    )


def run(args: argparse.Namespace) -> None:
    for key, value in (SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; `python -m bench.gpu_throughput --smoke` runs the CPU smoke version")
    torch.manual_seed(args.seed)
    models, kernels = parts(args)
    results = ResultsFolder(args.out)
    results.record(("run",), {
        "device": describe_device(device), "dtype": args.dtype, "smoke": args.smoke, "models": models,
        "kernels": kernels, "argv": vars(args),
    })
    print(f"device: {describe_device(device)}; dtype {args.dtype}" + ("; smoke run" if args.smoke else ""), flush=True)
    if not args.smoke:
        print_estimate(args)
    bandwidth = copy_bandwidth(device)
    release_memory(device)
    results.record(("copy_bandwidth_bytes_per_second",), bandwidth)
    print(f"copy bandwidth: {bandwidth / 1e9:,.1f} GB/s (bytes read + written)", flush=True)

    reports, failed = [], []
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as scratch:
        smoke_folders = write_smoke_models(Path(scratch)) if args.smoke else {}
        for model in [smoke_folders.get(name, name) for name in models]:
            try:
                reports.append(bench_model(model, args, device, bandwidth, results))
            except Exception as error:  # recorded; the next model and the kernel still run
                failed.append(model)
                results.record(("models", Path(model).name, "error"), _failure(model, "conveyor", error))
                release_memory(device)
                continue
            results.table(format_model(reports[-1], args))
            failed += [f"{reports[-1].label}: {side}" for side in reports[-1].failures]

    kernel_runs = None
    if kernels:
        try:
            kernel_runs = bench_kernel(args, device, bandwidth, results)
        except Exception as error:
            failed.append("decode attention kernel")
            results.record(("decode_attention_kernel", "error"), _failure("kernel", "decode attention", error))
    summary = format_summary(reports, kernel_runs, bandwidth, args.smoke)
    results.record(("summary",), summary)
    results.table(summary)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (errors above and in results.json)")


def parts(args: argparse.Namespace) -> tuple[list[str], bool]:
    """The models to run and whether to run the kernel: every model (MODELS, or --smoke's SMOKE_SHAPES) and the
    kernel by default; --models, --kernels or both pick."""
    if args.models is None and not args.kernels:
        return list(SMOKE_SHAPES if args.smoke else MODELS), True
    return args.models or [], args.kernels


def estimate_seconds(model: str, args: argparse.Namespace) -> dict[str, float]:
    """Seconds this model's part of the command should take on an H100, per side.

    conveyor: every decode step reads the weights and the running contexts' K/V (at HBM bandwidth,
    budgeted at the 1.5x-of-floor target) and prefill is 2 FLOPs per parameter per prompt token
    (at peak). HF: the same floors, with static batches padded to their longest prompt and run to
    their longest output, plus its eager per-layer launch cost on every decode step."""
    shape = ModelConfig.from_hf(resolve_model(model, "dummy").hf_config)
    requests = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), shape.vocab_size, args.seed)
    cap = args.hf_max_requests if args.hf_max_requests is not None else HF_MAX_REQUESTS.get(model, len(requests))
    hf_requests = requests[:cap]
    dtype = resolve_dtype(args.dtype, torch.device("cuda"))
    element_size = torch.tensor([], dtype=dtype).element_size()
    attention = 2 * (shape.num_attention_heads + shape.num_key_value_heads) * shape.head_dim  # q, k, v, o
    layer_params = shape.hidden_size * (attention + 3 * shape.intermediate_size)
    embeddings = (1 if shape.tie_word_embeddings else 2) * shape.vocab_size * shape.hidden_size
    params = shape.num_hidden_layers * layer_params + embeddings
    weight_bytes = params * element_size
    kv_per_token = bytes_per_block(shape, 1, dtype)
    hf_step_overhead = shape.num_hidden_layers * HF_SECONDS_PER_LAYER_STEP

    def prefill(tokens: int) -> float:
        return 2 * params * tokens / H100_BF16_FLOPS

    def continuous(batch: list[BenchRequest], overhead: float) -> float:
        """Every request admitted at once; step t decodes those with more than t tokens to go."""
        seconds = prefill(sum(len(r.prompt_token_ids) for r in batch))
        for t in range(max(r.output_len for r in batch)):
            contexts = sum(len(r.prompt_token_ids) + t for r in batch if r.output_len > t)
            seconds += (weight_bytes + contexts * kv_per_token) / H100_BANDWIDTH + overhead
        return seconds

    def static(batch_size: int) -> float:
        seconds = 0.0
        for first in range(0, len(hf_requests), batch_size):
            batch = hf_requests[first : first + batch_size]
            longest_prompt = max(len(r.prompt_token_ids) for r in batch)
            seconds += prefill(len(batch) * longest_prompt)
            for t in range(max(r.output_len for r in batch)):
                contexts = len(batch) * (longest_prompt + t)
                seconds += (weight_bytes + contexts * kv_per_token) / H100_BANDWIDTH + hf_step_overhead
        return seconds

    return {
        "builds": BUILD_SECONDS,
        "conveyor": CONVEYOR_FLOOR_FACTOR * continuous(requests, 0.0),
        "hf static generate": static(args.hf_batch_size),
        "hf generate_batch": continuous(hf_requests, hf_step_overhead),
    }


def print_estimate(args: argparse.Namespace) -> None:
    """The command's expected length on an H100, part by part, against the per-command limit."""
    seconds: dict[str, float] = {}
    models, kernels = parts(args)
    for model in models:
        if model in DUMMY_SHAPES:
            seconds |= {f"{model}: {side}": s for side, s in estimate_seconds(model, args).items()}
    if kernels:
        seconds["decode attention kernel"] = KERNEL_COMMAND_SECONDS
    total = sum(seconds.values())
    detail = ", ".join(f"{name} {part:.0f} s" for name, part in seconds.items())
    verdict = "within" if total <= COMMAND_LIMIT_SECONDS / 2 else "NOT well within"
    print(f"H100 estimate: {total / 60:.1f} min ({detail}); {verdict} the {COMMAND_LIMIT_SECONDS // 60}-minute "
          "per-command limit of a lent GPU", flush=True)


def bench_kernel(
    args: argparse.Namespace, device: torch.device, bandwidth: float, results: ResultsFolder
) -> list[KernelRun] | None:
    """The decode attention kernel over its grid of batches and contexts, each shape written as it is timed, then
    the table; None where it cannot run."""
    skipped = None
    if not TRITON_AVAILABLE:
        skipped = "Triton is not installed"
    elif device.type != "cuda" and not interpreter_enabled():
        skipped = "the Triton kernel needs CUDA, or TRITON_INTERPRET=1 on the CPU"
    if skipped is not None:
        print(f"decode attention kernel: skipped ({skipped})")
        results.record(("decode_attention_kernel", "skipped"), skipped)
        return None
    shape = ModelConfig.from_hf(SMOKE_SHAPES["tiny-llama"] if args.smoke else DUMMY_SHAPES["llama-3-8b"])
    batches, contexts = SMOKE_KERNEL_GRID if args.smoke else KERNEL_GRID
    dtype = resolve_dtype(args.dtype, device)
    repeats = SMOKE_KERNEL_REPEATS if args.smoke else KERNEL_REPEATS
    runs = []
    for context in contexts:
        for batch in batches:
            runs.append(bench_decode_attention(shape, batch, context, dtype, device, repeats=repeats))
            results.record(("decode_attention_kernel", "runs"), [
                {"batch": r.batch, "context": r.context, "seconds": r.seconds, "bytes_read": r.bytes_read,
                 "of_copy_bandwidth": r.fraction(bandwidth)} for r in runs
            ])
    results.table(format_kernel(runs, shape, bandwidth))
    return runs


if __name__ == "__main__":
    main()
