"""Mixture-of-experts throughput against the dense model of equal active parameters, side by side in one run.

For each MoE shape (named dummy shapes; `--small`: cut as `bench.throughput --small` cuts them, keeping
the expert count and top-k), conveyor runs the same workload on the shape and on its dense twin (same
attention, embeddings and layers; one SwiGLU MLP as wide as the experts a token runs through: top-k
experts plus any shared expert), with random weights. A token costs the same arithmetic in both; the
ratio shows what routing, grouping tokens by expert and reading many experts' weights cost on top. The
two alternate for --repeats rounds (each round a fresh workload seed, the same for both, so the prefix
cache has nothing to reuse), and the table gives the median of each side's tok/s and the median of the
rounds' ratios: on a shared machine the load drifts between rounds.

    python -m bench.moe --small                          # all MoE shapes, cut small, on the CPU
    python -m bench.moe --models qwen3-30b-a3b --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import markdown_table, run_cli
from bench.throughput import BenchResult, make_workload, run_conveyor, small_shape
from engine import LLM
from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.model_registry import DUMMY_SHAPES
from engine.models import MODEL_CLASSES

MOE_SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b")
_DENSE_FAMILY = {  # MoE architecture -> the dense one with the same attention
    "MixtralForCausalLM": ("MistralForCausalLM", "mistral"),
    "Qwen2MoeForCausalLM": ("Qwen2ForCausalLM", "qwen2"),
    "Qwen3MoeForCausalLM": ("Qwen3ForCausalLM", "qwen3"),
}
_MOE_KEYS = (
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
)


def dense_twin(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The dense shape with the same active parameters as the MoE shape `hf_config` (every layer sparse)."""
    config = ModelConfig.from_hf(hf_config)
    moe = config.moe
    if moe is None or len(moe.sparse_layers) != config.num_hidden_layers:
        raise ValueError(f"{config.architecture}: a dense twin needs a mixture-of-experts shape sparse in every layer")
    architecture, model_type = _DENSE_FAMILY[config.architecture]
    twin = {key: value for key, value in hf_config.items() if key not in _MOE_KEYS}
    twin.update(
        architectures=[architecture], model_type=model_type, attention_bias=config.attention_bias,
        intermediate_size=moe.top_k * moe.expert_intermediate_size + moe.shared_expert_intermediate_size,
    )
    return twin


def parameter_counts(hf_config: dict[str, Any]) -> tuple[int, int]:
    """(total, active per token) parameters of the model conveyor builds for `hf_config`: active leaves out
    the experts a token is not routed to."""
    config = ModelConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config, TorchAttention(False, 0))
    total = sum(p.numel() for p in model.parameters())
    if config.moe is None:
        return total, total
    moe = config.moe
    idle_experts = (moe.num_experts - moe.top_k) * 3 * config.hidden_size * moe.expert_intermediate_size
    return total, total - idle_experts * len(moe.sparse_layers)


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=list(MOE_SHAPES), choices=MOE_SHAPES)
    parser.add_argument("--small", action="store_true", help="the shapes cut to a few narrow layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of MoE then dense twin")
    parser.add_argument("--seed", type=int, default=0)


def build(hf_config: dict[str, Any], folder: Path, args: argparse.Namespace) -> LLM:
    """Conveyor on a config-only folder, with random weights."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(hf_config))
    return LLM(model=str(folder), load_format="dummy", dtype=args.dtype, device=args.device)


def paired_rounds(moe: LLM, dense: LLM, args: argparse.Namespace) -> list[tuple[BenchResult, BenchResult]]:
    """(MoE, dense twin) results of each round, run one right after the other on the same requests."""
    rounds = []
    vocab_size = moe.engine.model_config.vocab_size
    for round_index in range(args.repeats):
        requests = make_workload(
            args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size, args.seed + round_index
        )
        rounds.append((run_conveyor(moe, requests), run_conveyor(dense, requests)))
    return rounds


def run(args: argparse.Namespace) -> None:
    print(
        f"small={args.small} dtype={args.dtype} device={args.device} requests={args.num_requests} "
        f"prompt={args.prompt_len[0]}-{args.prompt_len[1]} output={args.output_len[0]}-{args.output_len[1]} "
        f"repeats={args.repeats} threads={torch.get_num_threads()}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as scratch:
        for name in args.models:
            moe_shape = small_shape(DUMMY_SHAPES[name]) if args.small else DUMMY_SHAPES[name]
            twin_shape = dense_twin(moe_shape)
            rounds = paired_rounds(
                build(moe_shape, Path(scratch) / name, args), build(twin_shape, Path(scratch) / f"{name}-dense", args), args
            )
            ratios = [moe.tokens_per_second / dense.tokens_per_second for moe, dense in rounds]
            print(f"{name}: MoE / dense twin per round: {', '.join(f'{r:.2f}' for r in ratios)}", flush=True)
            for side, label, shape in ((0, name, moe_shape), (1, "  dense twin", twin_shape)):
                total, active = parameter_counts(shape)
                tokens_per_second = statistics.median(pair[side].tokens_per_second for pair in rounds)
                ratio = statistics.median(ratios) if side == 0 else 1.0
                rows.append([label, f"{total / 1e6:.1f}M", f"{active / 1e6:.1f}M", f"{tokens_per_second:.1f}", f"{ratio:.2f}x"])
    print(markdown_table(["shape", "params", "active", "output tok/s (median)", "vs dense twin (median)"], rows))


if __name__ == "__main__":
    main()
