"""Turn a llama.cpp GGUF file (Llama, Qwen2/3, Phi-3, Gemma 2/3, and the mixtures of experts Mixtral, Qwen2-MoE and
Qwen3-MoE; byte-level or SentencePiece BPE vocabulary) into a Hugging Face model folder.

The folder holds `model.safetensors`, `config.json`, `generation_config.json`, `tokenizer.json` and
`tokenizer_config.json`, so this engine loads it like any checkpoint from the Hub (and `transformers` too when the
file has no quantized tensors).
Tensors keep the file's precision where it is a float type (F32 norms stay F32, F16 stays F16, BF16 stays
BF16); quantized tensors keep their blocks as they are (engine/quantization/gguf.py), as uint8 [rows, row_bytes]
tensors whose types `config.json`'s `quantization_config` names (`quant_method` "gguf", `tensor_types`), so the
folder is about the file's size and the engine reads exactly the file's values. That config makes the folder this
engine's own: transformers reads the GGUF file itself (`from_pretrained(..., gguf_file=...)`), not the folder.
A quantized type the engine cannot run is refused here, by name.
llama.cpp stacks a layer's experts into one tensor per projection (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`); they are written back one tensor per expert, as transformers saves MoE checkpoints.
RoPE scaling comes from the file: `rope.scaling.*` (linear, yarn), Llama 3.1's `rope_freqs` tensor of
per-frequency divisors, turned back into transformers' `llama3` parameters, and Phi-3's LongRoPE factors
(`rope_factors_long` / `rope_factors_short`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.quantization.gguf import check_supported
from engine.tokenizer import bos_eos_processor

log = logging.getLogger(__name__)

# Bump whenever a conversion's output changes: converted folders are cached under names carrying it. Version 3
# keeps quantized blocks (version 2 folders hold them dequantized to bf16, under the same tensor names).
CONVERTER_VERSION = 3

CONTROL_TOKEN = 3  # llama.cpp's token_type for special tokens such as <|im_start|>
USER_DEFINED_TOKEN = 4  # added tokens that are matched whole but are not special

# llama.cpp's `tokenizer.ggml.pre` names how text is split before BPE. These families are the ones
# whose split this module reproduces; each matches the `pre_tokenizer` of the original tokenizer.json.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact"}  # every digit on its own, then GPT-2's regex
_GPT2 = {"gpt2", "default"}
_LLAMA3 = {"llama-bpe", "llama3", "llama-v3"}
_QWEN2 = {"qwen2"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # Llama 3's with single digits
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF `general.architecture` -> the Hugging Face architecture it is imported as.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# llama.cpp files Mixtral as `llama` with experts.
_MIXTRAL = "MixtralForCausalLM"
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts, in Qwen-MoE's names; `{expert}`: the stacked tensor is split into one per expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Where a family's llama.cpp layout differs from Llama's.
_LAYER_TENSOR_OVERRIDES = {
    "llama": {  # Mixtral's names, as transformers saves them
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
        "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
        "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused, as in the HF checkpoint
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_LAYER_TENSOR_OVERRIDES["gemma3"] = _LAYER_TENSOR_OVERRIDES["gemma2"]
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Not weights: RoPE factors, read into config.json instead.
_ROPE_FREQS = "rope_freqs.weight"
_LONG_FACTORS, _SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"
_ROPE_TENSORS = {_ROPE_FREQS, _LONG_FACTORS, _SHORT_FACTORS}
# Default llama3 context the factors were computed for, when the file does not say (Llama 3.1's).
_LLAMA3_ORIGINAL_CONTEXT = 8192


def convert_gguf_to_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face folder into `out_dir` (created if missing) from `gguf_path`."""
    reader = gguf.GGUFReader(gguf_path)
    metadata = _read_metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {architecture!r} cannot be imported; supported: {sorted(_ARCHITECTURES)}"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    # Said before and after, with a bar over the tensors on a terminal: a first start converts for tens of seconds.
    log.info(
        "converting %s (%d tensors) into a Hugging Face folder under %s: a one-time step per file; later starts load "
        "the converted folder", gguf_path.name, len(tensors), out_dir.parent,
    )
    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = _hf_config(architecture, metadata, tensors)
    converted, quantized_types = _hf_tensors(architecture, tensors, hf_config)
    if quantized_types:
        hf_config["quantization_config"] = {"quant_method": "gguf", "tensor_types": quantized_types}
    save_file(converted, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", hf_config)
    generation = {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config}
    _write_json(out_dir / "generation_config.json", generation)
    _build_tokenizer(architecture, metadata).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(architecture, metadata))
    log.info("converted %s in %.0f s", gguf_path.name, time.monotonic() - started)


def _read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _as_float32_literal(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 arrives as 9.999999747e-06. The shortest float32 spelling is what
    # the original config.json said.
    return float(str(np.float32(value)))


def _hf_config(architecture: str, metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{architecture}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    layers = key("block_count")
    head_dim = key("attention.key_length") or hidden // heads
    embedding_dtype = _safetensors_dtype(tensors["token_embd.weight"].tensor_type)
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
    return _MIXTRAL if architecture == "llama" and metadata.get("llama.expert_count") else _ARCHITECTURES[architecture]


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
    if _LONG_FACTORS in tensors or _SHORT_FACTORS in tensors:
        if kind not in ("none", "longrope"):
            raise ValueError(f"GGUF has LongRoPE factors and rope.scaling.type {kind!r}")
        return _long_rope_scaling(tensors, key("rope.scaling.original_context_length"), key("context_length"),
                                  key("rope.scaling.attn_factor"))
    if _ROPE_FREQS in tensors:
        if kind not in ("none", "llama3"):
            raise ValueError(f"GGUF has both rope_freqs and rope.scaling.type {kind!r}")
        divisors = gguf.quants.dequantize(np.asarray(tensors[_ROPE_FREQS].data), tensors[_ROPE_FREQS].tensor_type)
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
    if _LONG_FACTORS not in tensors or _SHORT_FACTORS not in tensors or original_context is None:
        raise ValueError("GGUF LongRoPE needs rope_factors_long, rope_factors_short and rope.scaling.original_context_length")
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for name, tensor_name in (("short_factor", _SHORT_FACTORS), ("long_factor", _LONG_FACTORS)):
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


# The float types a tensor keeps; quantized ones keep their blocks.
_FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32: torch.float32,
    gguf.GGMLQuantizationType.F16: torch.float16,
    gguf.GGMLQuantizationType.BF16: torch.bfloat16,
}


def _safetensors_dtype(tensor_type: gguf.GGMLQuantizationType) -> torch.dtype:
    """The dtype a tensor loads as: its own float type, bfloat16 (what `dtype="auto"` runs) for quantized ones."""
    return _FLOAT_TYPES.get(tensor_type, torch.bfloat16)


def _hf_tensors(
    architecture: str, tensors: dict[str, Any], hf_config: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The Hugging Face-named tensors, and the GGUF type of each one kept as quantized blocks."""
    converted: dict[str, torch.Tensor] = {}
    quantized_types: dict[str, str] = {}
    gemma = architecture in ("gemma2", "gemma3")
    # disable=None: no bar where stderr is not a terminal (a worker's log file); none either where INFO is not shown.
    shown = tqdm(
        tensors.items(), desc="converting tensors", unit="tensor", file=sys.stderr,
        disable=None if log.isEnabledFor(logging.INFO) else True,
    )
    for gguf_name, tensor in shown:
        if gguf_name in _ROPE_TENSORS:
            continue
        name = _hf_name(architecture, gguf_name)
        quantized = tensor.tensor_type not in _FLOAT_TYPES
        # numpy's shape is GGUF's reversed, so a matrix arrives as (out_features, in_features) like torch's Linear
        # (quantized: (out_features, bytes of a row's blocks)). np.asarray drops the memmap subclass, whose
        # per-slice bookkeeping would dominate the time.
        if quantized:
            check_supported(tensor.tensor_type.name, gguf_name)
            weights = np.asarray(tensor.data)
        else:
            weights = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        # llama.cpp's q/k row order (rows are whole block rows, so blocks move as they are)
        if architecture == "llama" and name.endswith("q_proj.weight"):
            weights = _undo_rope_permutation(weights, hf_config["num_attention_heads"])
        elif architecture == "llama" and name.endswith("k_proj.weight"):
            weights = _undo_rope_permutation(weights, hf_config["num_key_value_heads"])
        if gemma and name.endswith("norm.weight"):
            weights = weights - 1  # llama.cpp stores Gemma's (1 + weight); the checkpoint holds weight
        names = [name.format(expert=expert) for expert in range(len(weights))] if "{expert}" in name else [name]
        # each expert its own copy: safetensors refuses tensors sharing memory
        pieces = [matrix.copy() for matrix in weights] if "{expert}" in name else [weights]
        for piece_name, piece in zip(names, pieces):
            if quantized:
                converted[piece_name] = torch.from_numpy(np.array(piece, dtype=np.uint8))  # its own, writable copy
                quantized_types[piece_name] = tensor.tensor_type.name
            else:
                converted[piece_name] = _to_torch(piece, _safetensors_dtype(tensor.tensor_type))
    return converted, quantized_types


def _to_torch(weights: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if not weights.flags.writeable:  # still the file's memory map (an F32 tensor): torch wants its own
        weights = weights.copy()
    return torch.from_numpy(weights).to(dtype)


def _hf_name(architecture: str, gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_names = {**_LAYER_TENSORS, **_LAYER_TENSOR_OVERRIDES.get(architecture, {})}
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face {_ARCHITECTURES[architecture]} counterpart")
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}.{match.group(3)}"


def _undo_rope_permutation(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp reorders each head's q/k rows of a `llama` model from HF's rotate-half layout [x0..x(d/2-1), y0..]
    to interleaved pairs [x0, y0, x1, y1, ...] (reshape(heads, 2, d/2).swapaxes(1, 2)); this puts the halves back.
    Other families run llama.cpp's NEOX rotation, on HF's own layout."""
    rows, columns = weights.shape
    head_dim = rows // heads
    return weights.reshape(heads, head_dim // 2, 2, columns).swapaxes(1, 2).reshape(rows, columns)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _LLAMA3 or pre in _QWEN2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    known = sorted(_DIGITS_THEN_GPT2 | _GPT2 | _LLAMA3 | _QWEN2)
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {known}")


def _build_tokenizer(architecture: str, metadata: dict[str, Any]) -> HFTokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_tokenizer(metadata)
    elif kind == "llama":
        tokenizer = _sentencepiece_tokenizer(architecture, metadata)
    else:
        raise ValueError(
            f"GGUF vocabulary {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer.post_processor = bos_eos_processor(
        bos=_special_token_and_id(metadata, "bos_token_id") if metadata.get("tokenizer.ggml.add_bos_token") else None,
        eos=_special_token_and_id(metadata, "eos_token_id") if metadata.get("tokenizer.ggml.add_eos_token") else None,
    )
    tokenizer.add_special_tokens([
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types) if token_type == CONTROL_TOKEN
    ])
    tokenizer.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types) if token_type == USER_DEFINED_TOKEN
    ])
    return tokenizer


def _byte_level_tokenizer(metadata: dict[str, Any]) -> HFTokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    if pre in _QWEN2:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_tokenizer(architecture: str, metadata: dict[str, Any]) -> HFTokenizer:
    """SentencePiece BPE with byte fallback (Llama 2, Phi-3, Gemma), as transformers builds it from a GGUF: the
    file has no merges, so they come from the vocabulary, best first (by score; by file position for Gemma,
    whose scores do not follow its merge order). How a leading space is made differs by family and the file
    does not say: Llama's Metaspace prepends one to the first word, Phi-3's normalizer to the text, Gemma none."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    gemma = architecture in ("gemma2", "gemma3")
    if gemma:  # runs of spaces are stored as spaces, but looked up as "▁"s
        tokens = ["▁" * len(token) if " " in token and not token.strip() else token for token in tokens]
        ranks = {token: -index for index, token in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, metadata["tokenizer.ggml.scores"]))
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    unknown = _special_token(metadata, "unknown_token_id") if gemma else None
    tokenizer = HFTokenizer(models.BPE(
        vocab=vocab, merges=_merges_from_vocabulary(vocab, ranks), unk_token=unknown, fuse_unk=True, byte_fallback=True,
    ))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif architecture == "phi3":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_vocabulary(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge, ranked by the merged token (higher first), then by
    the longer left part, the longer right part, and the parts' ids, as transformers orders them."""
    merges: list[tuple[str, str, float]] = []
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, rank) for left, right in pairs)
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _special_token_and_id(metadata: dict[str, Any], key: str) -> tuple[str, int] | None:
    token = _special_token(metadata, key)
    return None if token is None else (token, metadata[f"tokenizer.ggml.{key}"])


def _special_token(metadata: dict[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else metadata["tokenizer.ggml.tokens"][token_id]


def _tokenizer_config(architecture: str, metadata: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _special_token(metadata, "bos_token_id"),
        "eos_token": _special_token(metadata, "eos_token_id"),
        "unk_token": _special_token(metadata, "unknown_token_id"),
        "pad_token": _special_token(metadata, "padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata.get(f"{architecture}.context_length"),
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
