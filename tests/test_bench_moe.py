"""The MoE benchmark: a dense twin has the MoE shape's active parameters, shapes cut small keep their
family, and `python -m bench.moe --small` prints its table on the CPU."""

from __future__ import annotations

import pytest

from bench.moe import MOE_SHAPES, dense_twin, parameter_counts
from bench.throughput import small_shape
from engine.config import ModelConfig
from engine.model_registry import DUMMY_SHAPES


@pytest.mark.parametrize("name", MOE_SHAPES)
def test_dense_twin_has_the_active_parameters(name: str) -> None:
    published = DUMMY_SHAPES[name]
    shape = small_shape(published)
    small, full = ModelConfig.from_hf(shape), ModelConfig.from_hf(published)
    assert small.moe is not None and full.moe is not None
    assert (small.moe.num_experts, small.moe.top_k, small.moe.renormalize) == (
        full.moe.num_experts, full.moe.top_k, full.moe.renormalize,
    )
    assert small.moe.sparse_layers == tuple(range(small.num_hidden_layers))
    twin = ModelConfig.from_hf(dense_twin(shape))
    assert twin.moe is None and (twin.qk_norm, twin.attention_bias) == (small.qk_norm, small.attention_bias)
    moe_total, moe_active = parameter_counts(shape)
    twin_total, twin_active = parameter_counts(dense_twin(shape))
    gates = small.hidden_size * (small.moe.num_experts + (1 if small.moe.shared_expert_intermediate_size else 0))
    assert moe_active - twin_active == small.num_hidden_layers * gates and twin_total == twin_active < moe_total


@pytest.mark.slow
def test_moe_bench_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import moe

    moe.main([
        "--models", "qwen1.5-moe-a2.7b", "--small", "--num-requests", "2", "--prompt-len", "4", "8",
        "--output-len", "2", "4", "--repeats", "2",
    ])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row[0] for row in rows[2:]] == ["qwen1.5-moe-a2.7b", "dense twin"]
    assert rows[3][-1] == "1.00x"
