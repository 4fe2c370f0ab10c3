"""What ModelConfig reads from config.json for the families beyond Llama: per-layer windows as
transformers assigns them, Gemma's fields, RoPE scaling (checked against transformers' own tables, LongRoPE's
short and long ones included), and the refusal of quantized checkpoints."""

from __future__ import annotations

import pytest
import torch

from engine.config import DECODER_ARCHITECTURES, ModelConfig
from engine.model_registry import DUMMY_SHAPES
from engine.models import MODEL_CLASSES
from engine.models.llama import rope_attention_factor, rope_inverse_frequencies

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def config(architecture: str, **fields) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, "architectures": [architecture], **fields})


def test_every_architecture_has_a_model_class():
    assert set(MODEL_CLASSES) == set(DECODER_ARCHITECTURES)


def test_layer_windows_follow_transformers():
    assert config("MistralForCausalLM", sliding_window=8).layer_windows == (8,) * 6
    assert config("MistralForCausalLM", sliding_window=None).uniform_window is None
    assert config("Phi3ForCausalLM", sliding_window=8).uniform_window == 8
    # Qwen2/3: only with use_sliding_window, and only from max_window_layers on
    assert config("Qwen2ForCausalLM", sliding_window=8, max_window_layers=2).layer_windows == (None,) * 6
    qwen = config("Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True, max_window_layers=4)
    assert qwen.layer_windows == (None,) * 4 + (8, 8) and qwen.uniform_window is None
    assert config("Gemma2ForCausalLM", sliding_window=8).layer_windows == (8, None) * 3
    assert config("Gemma3ForCausalLM", sliding_window=8).layer_windows == (8,) * 5 + (None,)
    types = ["full_attention", "sliding_attention"] * 3
    assert config("Gemma3ForCausalLM", sliding_window=8, layer_types=types).layer_windows == (None, 8) * 3
    assert config("LlamaForCausalLM", sliding_window=8).uniform_window is None  # Llama has no window


def test_gemma_fields():
    gemma = ModelConfig.from_hf(DUMMY_SHAPES["gemma-2-9b"])
    assert (gemma.query_pre_attn_scalar, gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (256, 50.0, 30.0)
    assert gemma.hidden_activation == "gelu_tanh" and gemma.tie_word_embeddings and not gemma.qk_norm
    gemma3 = ModelConfig.from_hf(DUMMY_SHAPES["gemma-3-12b"])
    assert gemma3.qk_norm and (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    nested = config("Gemma3ForCausalLM", rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert (nested.rope_theta, nested.local_rope_theta, nested.rope_scaling["factor"]) == (1e6, 1e4, 8.0)


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "exl2"])
def test_unsupported_quantized_checkpoints_are_refused_by_name(method):
    with pytest.raises(
        ValueError, match=rf"quant_method='{method}'.*supported quantization methods: gguf, awq, gptq, fp8, compressed-tensors"
    ):
        config("LlamaForCausalLM", quantization_config={"quant_method": method, "bits": 4})


@pytest.mark.parametrize(("quantization", "message"), [
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, r"awq checkpoint with bits=3 .* supported: bits=4"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, r"group_size=-1 .* supported: 32, 64, 128"),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "gemv"}, r"version 'gemv' .* supported: gemm"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, r"activation_scheme='static' .* supported: dynamic"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"block-wise weight scales .* supported: per-tensor"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     r"compressed-tensors weights .* supported: compressed-tensors float8 weights"),
])
def test_unsupported_quantization_variants_are_refused_by_name(quantization, message):
    with pytest.raises(ValueError, match=message):
        config("LlamaForCausalLM", quantization_config=quantization)


def test_quantized_checkpoint_configs_are_read():
    awq = config("LlamaForCausalLM", quantization_config={"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                                           "version": "GEMM", "zero_point": True}).quantization
    assert awq.describe() == {"method": "awq", "bits": 4, "group_size": 64}
    gptq = config("LlamaForCausalLM", quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                            "desc_act": True}).quantization
    assert gptq.describe() == {"method": "gptq", "bits": 4, "group_size": 32, "act_order": True}
    assert gptq.zero_offset == 1
    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}
    tokens = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    fp8 = config("LlamaForCausalLM", quantization_config={
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights, "input_activations": tokens}},
    }).quantization
    assert fp8.describe() == {"method": "fp8", "bits": 8, "group_size": None, "checkpoint_method": "compressed-tensors",
                              "weight_scales": "channel", "activations": "fp8 per token, dynamic"}


def test_longrope_tables_match_transformers():
    """Phi-3's LongRoPE: the short factors up to the pretraining context, the long ones beyond, one attention
    factor from the two contexts; "su" (the first Phi-3 configs' name) reads the same; factors of the wrong
    length are refused."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 3.0 * i for i in range(8)]}
    contexts = {"max_position_embeddings": 256, "original_max_position_embeddings": 64}
    hf = transformers.Phi3Config(**BASE, **contexts, rope_theta=10000.0, rope_scaling={"type": "longrope", **scaling})
    ours = ModelConfig.from_hf(hf.to_dict())
    assert ours.long_rope_threshold == 64
    for seq_len, long_factors in ((64, False), (65, True)):
        expected, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
        assert torch.equal(rope_inverse_frequencies(16, 10000.0, ours.rope_scaling, long_factors), expected)
        assert rope_attention_factor(ours.rope_scaling) == attention_factor
    su = config("Phi3ForCausalLM", **contexts, rope_scaling={"type": "su", **scaling})
    assert su.rope_scaling == {**scaling, "type": "su", "rope_type": "longrope", "original_max_position_embeddings": 64,
                               "factor": 4.0}
    assert config("LlamaForCausalLM").long_rope_threshold is None
    wrong = config("Phi3ForCausalLM", rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]})
    with pytest.raises(ValueError, match="head_dim / 2 = 8"):
        rope_inverse_frequencies(wrong.head_dim, wrong.rope_theta, wrong.rope_scaling)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
])
def test_rope_scaling_matches_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(**BASE, max_position_embeddings=256, rope_theta=10000.0, rope_scaling=dict(scaling))
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    torch.testing.assert_close(rope_inverse_frequencies(16, 10000.0, scaling), expected, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(attention_factor)
