"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): each family's routing rules read from its
config, and checkpoints loaded in both of transformers' layouts. Their greedy output against Hugging Face
transformers' is tested with the dense families' (test_hf_equivalence.py, test_triton_engine.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model_registry import DUMMY_SHAPES
from tests.conftest import save_random_hf_model

MOE_KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


def test_routing_rules_of_each_family() -> None:
    mixtral = ModelConfig.from_hf({**DUMMY_SHAPES["mixtral-8x7b"], "norm_topk_prob": False}).moe
    assert mixtral is not None
    assert (mixtral.num_experts, mixtral.top_k, mixtral.expert_intermediate_size) == (8, 2, 14336)
    assert mixtral.renormalize  # always, whatever the config says
    assert mixtral.shared_expert_intermediate_size == 0 and mixtral.sparse_layers == tuple(range(32))

    qwen3 = ModelConfig.from_hf(DUMMY_SHAPES["qwen3-30b-a3b"])
    assert qwen3.moe is not None and qwen3.qk_norm and not qwen3.attention_bias
    assert (qwen3.moe.num_experts, qwen3.moe.top_k, qwen3.moe.renormalize) == (128, 8, True)
    assert qwen3.moe.shared_expert_intermediate_size == 0
    # transformers 5 saves Qwen3-MoE's num_experts under its alias, num_local_experts
    saved_by_v5 = {k: v for k, v in DUMMY_SHAPES["qwen3-30b-a3b"].items() if k != "num_experts"}
    assert ModelConfig.from_hf({**saved_by_v5, "num_local_experts": 16}).moe.num_experts == 16  # type: ignore[union-attr]

    qwen2 = ModelConfig.from_hf(DUMMY_SHAPES["qwen1.5-moe-a2.7b"])
    assert qwen2.moe is not None and qwen2.attention_bias and not qwen2.qk_norm
    assert (qwen2.moe.num_experts, qwen2.moe.top_k, qwen2.moe.renormalize) == (60, 4, False)
    assert qwen2.moe.shared_expert_intermediate_size == 5632 and qwen2.intermediate_size == 5632
    without_flag = {k: v for k, v in DUMMY_SHAPES["qwen1.5-moe-a2.7b"].items() if k != "norm_topk_prob"}
    assert not ModelConfig.from_hf(without_flag).moe.renormalize  # type: ignore[union-attr]

    sparse = ModelConfig.from_hf({**DUMMY_SHAPES["qwen3-30b-a3b"], "decoder_sparse_step": 3, "mlp_only_layers": [5]})
    assert sparse.moe is not None and sparse.moe.sparse_layers == tuple(i for i in range(2, 48, 3) if i != 5)
    assert ModelConfig.from_hf(DUMMY_SHAPES["llama-3-8b"]).moe is None
    with pytest.raises(ValueError, match="num_experts_per_tok must be in \\[1, 8\\]"):
        ModelConfig.from_hf({**DUMMY_SHAPES["mixtral-8x7b"], "num_experts_per_tok": 9})


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_checkpoint_layouts_load_alike(kind, tmp_path) -> None:
    """Saved checkpoints hold one tensor per expert and projection; transformers 5's modules hold them stacked
    (`mlp.experts.gate_up_proj`). Both fill the same stacked parameters, and every parameter."""
    import transformers

    from engine.attention import TorchAttention
    from engine.loader import iter_safetensors
    from engine.models.moe import MoeForCausalLM

    folder = save_random_hf_model(kind, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = ModelConfig.from_hf(hf.config.to_dict())
    from_files, from_modules = (MoeForCausalLM(config, TorchAttention(False, 0)) for _ in range(2))
    from_files.load_weights(iter_safetensors(folder))
    stacked = dict(hf.state_dict())
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in stacked)
    from_modules.load_weights(stacked.items())
    for (name, a), (_, b) in zip(from_files.named_parameters(), from_modules.named_parameters()):
        assert torch.equal(a, b), name
    first_experts = next(name for name in stacked if name.endswith("mlp.experts.down_proj"))
    assert torch.equal(from_files.get_parameter(first_experts), stacked[first_experts])


def test_unknown_expert_tensor_is_refused(tmp_path) -> None:
    from engine.attention import TorchAttention
    from engine.models.moe import MoeForCausalLM

    folder = save_random_hf_model("mixtral", tmp_path)
    import transformers

    config = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(folder).to_dict())
    model = MoeForCausalLM(config, TorchAttention(False, 0))
    with pytest.raises(ValueError, match="unexpected tensor"):
        model.load_weights([("model.layers.0.block_sparse_moe.experts.0.w4.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="4 experts"):
        model.load_weights([("model.layers.0.block_sparse_moe.experts.4.w1.weight", torch.zeros(1))])


def test_sliding_windows_follow_each_family() -> None:
    """Mixtral and Qwen3-MoE window every layer (Qwen3-MoE only with use_sliding_window); Qwen2-MoE the
    layers transformers' own config marks sliding."""
    import transformers

    mixtral = ModelConfig.from_hf({**DUMMY_SHAPES["mixtral-8x7b"], "num_hidden_layers": 3, "sliding_window": 64})
    assert mixtral.layer_windows == (64, 64, 64)
    qwen3 = {**DUMMY_SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 3, "sliding_window": 64}
    assert ModelConfig.from_hf(qwen3).layer_windows == (None, None, None)
    assert ModelConfig.from_hf({**qwen3, "use_sliding_window": True}).layer_windows == (64, 64, 64)
    hf = transformers.Qwen2MoeConfig(num_hidden_layers=5, use_sliding_window=True, sliding_window=64, max_window_layers=3)
    expected = tuple(64 if kind == "sliding_attention" else None for kind in hf.layer_types)
    assert 64 in expected and None in expected
    windowed = {**DUMMY_SHAPES["qwen1.5-moe-a2.7b"], "num_hidden_layers": 5, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 3}
    assert ModelConfig.from_hf(windowed).layer_windows == expected
