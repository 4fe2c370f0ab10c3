"""Quantized weights on the CPU against the dtype the CPU runs fastest (the engine's `auto`: bf16 where it has AVX-512
BF16 or AMX, else float32), one process, side by side: output tok/s on a decode-heavy slice of bench/throughput's workload (random prompt ids,
greedy, `ignore_eos`, every request submitted at once), and the bytes of the weights the model holds.

Rows, all the bundled SmolLM2-135M (or `--gguf FILE`):
- bf16 (or float32): the GGUF's values dequantized into an unquantized bf16 folder (what the import wrote before it
  kept blocks), run in that dtype;
- int8 / int4: that folder with `quantization="int8" / "int4"` (weight-only, groups of 64, at load);
- gguf <types>: the file's blocks as they are (SmolLM2's: Q4_1 matrices, a Q8_0 embedding), and the same model
  requantized to Q8_0 by gguf-py (what importing a Q8_0 file of it gives).
Activations are in that dtype, and with `--activations int8` (the default runs both) each quantized row runs again with
`quantized_activations="int8"` (its matmuls quantize the activations to int8 per token, blocks of 32, and
multiply with integer dot products), its label ending "+ int8 activations". A second table states int8's and
int4's error against the unquantized model (float32, greedy), with int8 activations too where asked. Weight bytes:
the projections' matrices as held (blocks and scales for the quantized rows; one copy for bf16, whose
oneDNN-packed copy beside it is not counted) plus the embedding.

    python -m bench.quantized --num-requests 32 --prompt-len 16 64 --output-len 64 128
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from bench.common import markdown_table, ratio, run_cli
from bench.report import describe_machine
from bench.throughput import BenchResult, make_workload, run_conveyor
from engine import LLM, SamplingParams
from engine.dtypes import resolve_dtype
from engine.model_registry import DEFAULT_MODEL, resolve_model
from engine.parallel_layers import QuantizableLinear
from engine.quantization.gguf import GGUFTensor
from conveyor_kernels.quantized_matmul import auto_path, int8_path


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gguf", default=DEFAULT_MODEL, help="a .gguf file (default: the bundled SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 128))
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice, the core count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--error-tokens", type=int, default=32, help="greedy tokens per prompt of the error table")
    parser.add_argument(
        "--activations", nargs="+", choices=["none", "int8"], default=["none", "int8"],
        help="the quantized rows' activations: none (the model's dtype) and / or int8 (quantized_activations)",
    )


def _float_folder(converted: Path, out: Path) -> Path:
    """The converted GGUF folder with every block tensor dequantized to bf16 and no quantization_config."""
    config = json.loads((converted / "config.json").read_text())
    types = config.pop("quantization_config", {}).get("tensor_types", {})
    tensors = load_file(str(converted / "model.safetensors"))
    for name, type_name in types.items():
        tensors[name] = GGUFTensor(tensors[name], type_name)[:].to(torch.bfloat16)
    return _write_folder(converted, out, tensors, config)


def _requantized_folder(converted: Path, out: Path, type_name: str) -> Path:
    """The converted folder with every block tensor requantized to `type_name` by gguf-py's quantizer."""
    config = json.loads((converted / "config.json").read_text())
    types = config["quantization_config"]["tensor_types"]
    tensors = load_file(str(converted / "model.safetensors"))
    quant_type = gguf.GGMLQuantizationType[type_name]
    for name in types:
        values = GGUFTensor(tensors[name], types[name])[:].numpy()
        tensors[name] = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(values, quant_type)))
        types[name] = type_name
    return _write_folder(converted, out, tensors, config)


def _write_folder(converted: Path, out: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted / name, out / name)
    return out


def weight_bytes(llm: LLM) -> int:
    """Bytes of the projections' weights as held (blocks, scales, their repack for int8 activations, or one float
    copy) and of the embedding (a GGUF's blocks, or float; nothing of its own where it reads a tied quantized output
    projection's rows)."""
    model = llm.engine.model
    embedding = model.model.embed_tokens
    total = 0 if embedding.shared_rows is not None else (
        embedding.weight if embedding.blocks is None else embedding.blocks).nbytes
    for module in model.modules():
        if not isinstance(module, QuantizableLinear):
            continue
        if hasattr(module, "gguf_pieces"):
            total += sum(piece.weight.nbytes for piece in module.gguf_pieces)
        elif hasattr(module, "qweight"):
            total += module.qweight.nbytes
        else:
            total += module.weight.nbytes
    return total


def error_table(float_folder: Path, requests: list, tokens: int, activations: list[str]) -> str:
    """int8 / int4 (each with the `activations` asked: "none", "int8") against the unquantized model, all in float32,
    greedy over the workload's prompts: the share of
    generated tokens equal to the unquantized model's (up to each sequence's first difference, after which the two
    continue from different texts); at the first generated position, how often the unquantized model's top token
    is the quantized one's too, and the largest and median difference in log-probability over the top-5 tokens
    both models rank."""
    prompts = [r.prompt_token_ids for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=5)
    runs = [(method, activation) for method in ("int8", "int4") for activation in activations]
    outputs = {}
    for method, activation in [(None, "none"), *runs]:
        llm = LLM(model=str(float_folder), dtype="float32", device="cpu", quantization=method,
                  quantized_activations=_quantized_activations(activation))
        outputs[method, activation] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    rows = []
    for method, activation in runs:
        agreeing, same_top, differences = 0, 0, []
        for reference, quantized in zip(outputs[None, "none"], outputs[method, activation]):
            agreeing += next((i for i, (a, b) in enumerate(zip(reference.token_ids, quantized.token_ids)) if a != b),
                             len(reference.token_ids))
            same_top += reference.token_ids[0] == quantized.token_ids[0]
            first, first_quantized = reference.logprobs[0], quantized.logprobs[0]
            differences += [abs(first[t] - first_quantized[t]) for t in first if t in first_quantized]
        rows.append((_label(method, activation), f"{agreeing / (len(prompts) * tokens):.1%}",
                     f"{same_top / len(prompts):.0%}",
                     f"{max(differences):.3f}", f"{float(np.median(differences)):.3f}"))
    return markdown_table(
        ["float32, vs unquantized", "greedy tokens equal", "1st token equal", "max |d logprob|", "median |d logprob|"],
        rows,
    )


def _quantized_activations(activation: str) -> str | None:
    """The engine option of an --activations choice ("none": the model's dtype)."""
    return None if activation == "none" else activation


def _label(weights: str, activation: str) -> str:
    return weights if activation == "none" else f"{weights} + {activation} activations"


def run(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.gguf)
    assert source.path is not None
    requests = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                             source.hf_config["vocab_size"], args.seed)
    types = ", ".join(f"{name} x{count}" for name, count in sorted(
        {t: list(source.hf_config["quantization_config"]["tensor_types"].values()).count(t)
         for t in set(source.hf_config["quantization_config"]["tensor_types"].values())}.items()))
    dtype = resolve_dtype("auto", torch.device("cpu"))
    dtype_name = "bf16" if dtype == torch.bfloat16 else "float32"
    paths = auto_path(dtype) + (f", with int8 activations {int8_path()}" if "int8" in args.activations else "")
    print(f"CPU: {describe_machine('cpu')}; {torch.get_num_threads()} threads; quantized kernels' path: {paths}")
    print(f"{args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]}, max_num_seqs {args.max_num_seqs}, activations {dtype_name} "
          f"unless a row says int8", flush=True)
    rows: list[tuple[str, BenchResult, int]] = []
    with tempfile.TemporaryDirectory() as scratch:
        float_folder = _float_folder(source.path, Path(scratch) / "bf16")
        q8_folder = _requantized_folder(source.path, Path(scratch) / "q8_0", "Q8_0")
        quantized = [
            ("int8 (group 64)", float_folder, {"quantization": "int8"}),
            ("int4 (group 64)", float_folder, {"quantization": "int4"}),
            ("gguf Q8_0", q8_folder, {}),
            (f"gguf as the file ({types})", source.path, {}),
        ]
        setups = [
            (dtype_name, float_folder, {}),
            *[(_label(label, activation), folder, {**options,
                                                   "quantized_activations": _quantized_activations(activation)})
              for label, folder, options in quantized for activation in args.activations],
            (f"{dtype_name} again (drift check)", float_folder, {}),  # a busy machine shows as the two rows differing
        ]
        for label, folder, options in setups:
            llm = LLM(model=str(folder), dtype=str(dtype).removeprefix("torch."), device="cpu",
                      max_num_seqs=args.max_num_seqs, **options)
            rows.append((label, run_conveyor(llm, requests), weight_bytes(llm)))
            print(f"  {label}: {rows[-1][1].tokens_per_second:.1f} tok/s", flush=True)
            del llm
        print(error_table(float_folder, requests, args.error_tokens, args.activations), flush=True)
    baseline, baseline_bytes = rows[0][1], rows[0][2]
    print(markdown_table(
        ["weights", "output tok/s", f"vs {dtype_name}", "weight MiB", f"vs {dtype_name}"],
        [(label, f"{result.tokens_per_second:.1f}", ratio(result.tokens_per_second, baseline.tokens_per_second),
          f"{size / 2**20:.1f}", ratio(baseline_bytes, size).replace("x", "x smaller"))
         for label, result, size in rows],
    ))


if __name__ == "__main__":
    main()
