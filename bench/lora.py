"""LoRA adapters' cost: one batch of lines spread over 1, 4 and 16 adapters against the base model alone on the same
lines, side by side in one run, one engine (max_loras = 16, every adapter registered once).

The adapters are random rank-16 PEFT folders over all seven projections (q, k, v, o, gate, up, down), written by this
script; greedy decoding with ignore_eos, so every run generates the same number of tokens. The runs alternate for
--repeats rounds and the table gives each run's median tok/s and its median ratio to the base run of the same round
(the load of a shared machine drifts between rounds). Prefix caching is off, so no run reuses another's prompts.

    python -m bench.lora                       # SmolLM2-135M, bf16 on the CPU
    python -m bench.lora --threads 1 --clock cpu   # on a loaded shared machine: tokens per CPU second of one thread
    python -m bench.lora --device cuda --lines 256
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import markdown_table
from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.lora import ATTENTION_TARGETS, MLP_TARGETS, projection_shapes

ADAPTER_COUNTS = (1, 4, 16)


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder over every projection of `config`'s layers."""
    generator = torch.Generator().manual_seed(seed)
    targets = [*ATTENTION_TARGETS, *MLP_TARGETS]
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (in_features, out_features) in projection_shapes(config).items():
            part = "self_attn" if module in ATTENTION_TARGETS else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.01 * torch.randn(rank, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(out_features, rank, generator=generator)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lines", type=int, default=32, help="lines of the batch")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU seconds instead of wall time, which other work on a loaded machine "
                        "stretches (with --threads 1, so no thread waits on another)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, enable_lora=True, max_loras=max(ADAPTER_COUNTS),
              max_lora_rank=args.rank, enable_prefix_caching=False, max_num_seqs=args.lines)
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(max(ADAPTER_COUNTS)):
            folder = Path(scratch) / f"adapter-{index}"
            write_adapter(folder, llm.engine.model_config, args.rank, index)
            llm.add_lora(f"adapter-{index}", str(folder))
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.lines)]

    def run(adapters: int) -> float:
        params = [
            SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                           adapter=f"adapter-{line % adapters}" if adapters else None)
            for line in range(args.lines)
        ]
        started = clock()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = clock() - started
        return sum(len(output.outputs[0].token_ids) for output in outputs) / seconds

    run(0), run(max(ADAPTER_COUNTS))  # warm-up: first-use costs out of the figures
    counts = (0, *ADAPTER_COUNTS)
    speeds: dict[int, list[float]] = {count: [] for count in counts}
    ratios: dict[int, list[float]] = {count: [] for count in counts}
    for _ in range(args.repeats):
        round_speeds = {count: run(count) for count in counts}
        for count in counts:
            speeds[count].append(round_speeds[count])
            ratios[count].append(round_speeds[count] / round_speeds[0])
    rows = [
        ["base model" if count == 0 else f"{count} adapter{'s' * (count > 1)} (rank {args.rank})",
         f"{statistics.median(speeds[count]):.1f}", f"{statistics.median(ratios[count]):.2f}x"]
        for count in counts
    ]
    print(f"{args.model}, {args.dtype} on {args.device} ({torch.get_num_threads()} threads): {args.lines} lines of "
          f"{args.prompt_tokens} prompt tokens, {args.max_tokens} generated each; median of {args.repeats} rounds; "
          f"{args.clock} clock")
    unit = "generated tok/s" if args.clock == "wall" else "generated tok per CPU s"
    print(markdown_table(["run", unit, "vs base"], rows))


if __name__ == "__main__":
    main()
