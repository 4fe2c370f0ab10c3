"""A GGUF file's tensors as a Hugging Face checkpoint's (engine/gguf_import.py): llama.cpp's names mapped to
transformers' per family, float tensors kept in the file's precision, quantized ones as their blocks (uint8
[rows, row_bytes], a type the engine cannot run refused by name), llama.cpp's q/k RoPE permutation undone
(`llama`), Gemma's stored (1 + weight) norms turned back, and stacked expert tensors split into one per expert."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from engine.quantization.gguf import check_supported

log = logging.getLogger(__name__)

# GGUF `general.architecture` -> the Hugging Face architecture it is imported as.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}

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
ROPE_FREQS = "rope_freqs.weight"
LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"
_ROPE_TENSORS = {ROPE_FREQS, LONG_FACTORS, SHORT_FACTORS}


# The float types a tensor keeps; quantized ones keep their blocks.
_FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32: torch.float32,
    gguf.GGMLQuantizationType.F16: torch.float16,
    gguf.GGMLQuantizationType.BF16: torch.bfloat16,
}


def safetensors_dtype(tensor_type: gguf.GGMLQuantizationType) -> torch.dtype:
    """The dtype a tensor loads as: its own float type, bfloat16 (what `dtype="auto"` runs) for quantized ones."""
    return _FLOAT_TYPES.get(tensor_type, torch.bfloat16)


def hf_tensors(
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
                converted[piece_name] = _to_torch(piece, safetensors_dtype(tensor.tensor_type))
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
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face {ARCHITECTURES[architecture]} counterpart")
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}.{match.group(3)}"


def _undo_rope_permutation(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp reorders each head's q/k rows of a `llama` model from HF's rotate-half layout [x0..x(d/2-1), y0..]
    to interleaved pairs [x0, y0, x1, y1, ...] (reshape(heads, 2, d/2).swapaxes(1, 2)); this puts the halves back.
    Other families run llama.cpp's NEOX rotation, on HF's own layout."""
    rows, columns = weights.shape
    head_dim = rows // heads
    return weights.reshape(heads, head_dim // 2, 2, columns).swapaxes(1, 2).reshape(rows, columns)
