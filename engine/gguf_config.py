"""A GGUF file's metadata as a Hugging Face `config.json` (engine/gguf_import.py): the model's shape, its family's
fields (Gemma's scaling and soft-capping, sliding windows, mixtures of experts) and RoPE scaling from
`rope.scaling.*`, Llama 3.1's `rope_freqs` divisors (as transformers' `llama3` parameters) or Phi-3's LongRoPE
factor tensors."""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np

from engine.gguf_tensors import ARCHITECTURES, LONG_FACTORS, ROPE_FREQS, SHORT_FACTORS, safetensors_dtype

# llama.cpp files Mixtral as `llama` with experts.
_MIXTRAL = "MixtralForCausalLM"
# Default llama3 context the factors were computed for, when the file does not say (Llama 3.1's).
_LLAMA3_ORIGINAL_CONTEXT = 8192


def _as_float32_literal(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 arrives as 9.999999747e-06. The shortest float32 spelling is what
    # the original config.json said.
    return float(str(np.float32(value)))


def build_hf_config(architecture: str, metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{architecture}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    layers = key("block_count")
    head_dim = key("attention.key_length") or hidden // heads
    embedding_dtype = safetensors_dtype(tensors["token_embd.weight"].tensor_type)
    config: dict[str, Any] = {
        "architectures": [_hf_architecture(architecture, metadata)],
        "model_type": architecture,
        "vocab_size": key("vocab_size") or len(metadata["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _as_float32_literal(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _as_float32_literal(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(architecture, metadata, tensors, head_dim),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        # The matrices' type (the norms may be wider), which transformers loads the model as.
        "torch_dtype": str(embedding_dtype).removeprefix("torch."),
    }
    if (config["rope_scaling"] or {}).get("rope_type") == "longrope":
        # Phi-3's config keeps the pretraining context here, and transformers reads it from here first.
        config["original_max_position_embeddings"] = config["rope_scaling"]["original_max_position_embeddings"]
    if architecture in ("qwen2", "qwen2moe", "qwen3moe"):
        config["use_sliding_window"] = False  # llama.cpp runs the Qwen families without a window
    if key("expert_count"):
        config.update(_moe_config(architecture, metadata, tensors))
    if architecture == "phi3" and key("attention.sliding_window"):
        config["sliding_window"] = key("attention.sliding_window")
    if architecture in ("gemma2", "gemma3"):
        config["model_type"] = "gemma3_text" if architecture == "gemma3" else "gemma2"
        del config["hidden_act"]
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["sliding_window"] = key("attention.sliding_window")
        # llama.cpp scales queries by 1/sqrt(hidden / heads) for the 27B models (46 and 62 layers), else by
        # 1/sqrt(head_dim): the value of query_pre_attn_scalar their checkpoints carry.
        config["query_pre_attn_scalar"] = hidden // heads if layers in (46, 62) else head_dim
        config["attn_logit_softcapping"] = key("attn_logit_softcapping")
        config["final_logit_softcapping"] = key("final_logit_softcapping")
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            config["layer_types"] = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
        elif architecture == "gemma3":
            config["sliding_window_pattern"] = pattern or 6
        if architecture == "gemma3":
            config["rope_local_base_freq"] = _as_float32_literal(key("rope.freq_base_swa", 10000.0))
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in metadata:
            config[hf_key] = metadata[f"tokenizer.ggml.{gguf_key}"]
    return config


def _hf_architecture(architecture: str, metadata: dict[str, Any]) -> str:
    return _MIXTRAL if architecture == "llama" and metadata.get("llama.expert_count") else ARCHITECTURES[architecture]


def _moe_config(architecture: str, metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The experts' config.json fields. Routing follows llama.cpp, which renormalises the top-k weights of Mixtral
    and Qwen3-MoE and not Qwen2-MoE's, unless the file says (`expert_weights_norm`). A Qwen layer without a router
    is dense (transformers' `mlp_only_layers`)."""
    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{architecture}.{name}", default)

    if architecture == "llama":
        return {"model_type": "mixtral", "num_local_experts": key("expert_count"),
                "num_experts_per_tok": key("expert_used_count")}
    config = {
        "model_type": "qwen2_moe" if architecture == "qwen2moe" else "qwen3_moe",
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "norm_topk_prob": bool(key("expert_weights_norm", architecture == "qwen3moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            layer for layer in range(key("block_count")) if f"blk.{layer}.ffn_gate_inp.weight" not in tensors
        ],
    }
    if architecture == "qwen2moe":
        config["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length", 0)
        config["qkv_bias"] = "blk.0.attn_q.bias" in tensors  # transformers' name for Qwen2-MoE's attention_bias
    return config


def _rope_scaling(architecture: str, metadata: dict[str, Any], tensors: dict[str, Any], head_dim: int) -> dict | None:
    """transformers' rope_scaling from the file: `rope.scaling.type` linear or yarn, `rope_freqs`, or LongRoPE's
    factor tensors."""
    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{architecture}.{name}", default)

    kind = key("rope.scaling.type", "none")
    if LONG_FACTORS in tensors or SHORT_FACTORS in tensors:
        if kind not in ("none", "longrope"):
            raise ValueError(f"GGUF has LongRoPE factors and rope.scaling.type {kind!r}")
        return _long_rope_scaling(tensors, key("rope.scaling.original_context_length"), key("context_length"),
                                  key("rope.scaling.attn_factor"))
    if ROPE_FREQS in tensors:
        if kind not in ("none", "llama3"):
            raise ValueError(f"GGUF has both rope_freqs and rope.scaling.type {kind!r}")
        divisors = gguf.quants.dequantize(np.asarray(tensors[ROPE_FREQS].data), tensors[ROPE_FREQS].tensor_type)
        return _llama3_scaling(divisors.astype(np.float64), _as_float32_literal(key("rope.freq_base", 10000.0)),
                               head_dim, key("rope.scaling.original_context_length") or _LLAMA3_ORIGINAL_CONTEXT)
    if kind == "none":
        return None
    factor = _as_float32_literal(key("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": key("rope.scaling.original_context_length")}
        for name, gguf_name in (("beta_fast", "rope.scaling.yarn_beta_fast"), ("beta_slow", "rope.scaling.yarn_beta_slow")):
            if key(gguf_name) is not None:
                scaling[name] = _as_float32_literal(key(gguf_name))
        return scaling
    raise ValueError(f"GGUF rope.scaling.type {kind!r} is not supported; supported: none, linear, yarn, rope_freqs")


def _long_rope_scaling(
    tensors: dict[str, Any], original_context: int | None, context: int, attention_factor: float | None
) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: the short and long factors as tensors, the pretraining
    context, and the attention factor it computed from the two contexts (as transformers does when the config
    gives none: kept only where it differs from that)."""
    if LONG_FACTORS not in tensors or SHORT_FACTORS not in tensors or original_context is None:
        raise ValueError("GGUF LongRoPE needs rope_factors_long, rope_factors_short and rope.scaling.original_context_length")
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for name, tensor_name in (("short_factor", SHORT_FACTORS), ("long_factor", LONG_FACTORS)):
        tensor = tensors[tensor_name]
        factors = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        scaling[name] = [_as_float32_literal(factor) for factor in factors.reshape(-1)]
    scaling["original_max_position_embeddings"] = original_context
    factor = context / original_context
    default = math.sqrt(1 + math.log(factor) / math.log(original_context)) if factor > 1 else 1.0
    if attention_factor is not None and not math.isclose(attention_factor, default, rel_tol=1e-6):
        scaling["attention_factor"] = _as_float32_literal(attention_factor)
    return scaling


def _llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int, original_context: int) -> dict[str, Any]:
    """The llama3 parameters whose per-frequency divisors are `divisors` (what llama.cpp's converter wrote).
    Divisors are 1 for short wavelengths, `factor` for long ones, and between them 1 / ((1 - s) / factor + s)
    with s = original_context / ((high - low) * wavelength) - low / (high - low): two of the three remaining
    parameters fix the curve, so the context is taken as given and low/high solved from the smooth part."""
    factor = float(divisors.max())
    wavelengths = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (1 / divisors - 1 / factor) / (1 - 1 / factor) if factor > 1 else np.zeros_like(divisors)
    between = (smooth > 1e-6) & (smooth < 1 - 1e-6)
    if factor <= 1 or between.sum() < 2:
        raise ValueError("GGUF rope_freqs does not follow Llama 3's scaling (too few smoothly scaled frequencies)")
    slope, intercept = np.polyfit(1 / wavelengths[between], smooth[between], 1)  # s = slope / wavelength + intercept
    low, high = -intercept * original_context / slope, (1 - intercept) * original_context / slope
    scaling = {"rope_type": "llama3", "factor": _round(factor), "low_freq_factor": _round(low),
               "high_freq_factor": _round(high), "original_max_position_embeddings": original_context}
    expected = _llama3_divisors(scaling, wavelengths)
    if not np.allclose(expected, divisors, rtol=1e-4):
        raise ValueError("GGUF rope_freqs does not follow Llama 3's scaling")
    return scaling


def _llama3_divisors(scaling: dict[str, Any], wavelengths: np.ndarray) -> np.ndarray:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    smooth = np.clip((context / wavelengths - low) / (high - low), 0, 1)
    return 1 / ((1 - smooth) / factor + smooth)


def _round(value: float) -> float:
    """The parameter as a config would spell it: float32 noise of the fit removed."""
    return float(f"{value:.4g}")
