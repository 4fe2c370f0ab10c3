"""Turn a llama.cpp GGUF file (llama architecture, byte-level BPE vocabulary) into a Hugging Face model folder.

The folder holds float32 `model.safetensors`, `config.json`, `generation_config.json`, `tokenizer.json` and
`tokenizer_config.json`, so both this engine and `transformers` load it like any checkpoint from the Hub.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import bos_eos_processor

CONTROL_TOKEN = 3  # llama.cpp's token_type for special tokens such as <|im_start|>
USER_DEFINED_TOKEN = 4  # added tokens that are matched whole but are not special

# llama.cpp's `tokenizer.ggml.pre` names how text is split before BPE. These families are the ones
# whose split this module reproduces; each matches the `pre_tokenizer` of the original tokenizer.json.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact"}  # every digit on its own, then GPT-2's regex
_GPT2 = {"gpt2", "default"}
_LLAMA3 = {"llama-bpe", "llama3", "llama-v3"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def convert_gguf_to_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face Llama folder into `out_dir` (created if missing) from `gguf_path`."""
    reader = gguf.GGUFReader(gguf_path)
    metadata = _read_metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"{gguf_path}: only GGUF architecture 'llama' can be imported, got {architecture!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = _hf_config(metadata, tensor_names={tensor.name for tensor in reader.tensors})
    save_file(_hf_tensors(reader, hf_config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", hf_config)
    generation = {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config}
    _write_json(out_dir / "generation_config.json", generation)
    _build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(metadata))


def _read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _as_float32_literal(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 arrives as 9.999999747e-06. The shortest float32 spelling is what
    # the original config.json said.
    return float(str(np.float32(value)))


def _hf_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    def llama(key: str, default: Any = None) -> Any:
        return metadata.get(f"llama.{key}", default)

    scaling = llama("rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with RoPE scaling (rope.scaling.type or rope_freqs) are not supported")
    heads = llama("attention.head_count")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": llama("vocab_size") or len(metadata["tokenizer.ggml.tokens"]),
        "hidden_size": llama("embedding_length"),
        "intermediate_size": llama("feed_forward_length"),
        "num_hidden_layers": llama("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": llama("attention.head_count_kv", heads),
        "head_dim": llama("attention.key_length") or llama("embedding_length") // heads,
        "hidden_act": "silu",
        "rms_norm_eps": _as_float32_literal(llama("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _as_float32_literal(llama("rope.freq_base", 10000.0)),
        "max_position_embeddings": llama("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in metadata:
            config[hf_key] = metadata[f"tokenizer.ggml.{gguf_key}"]
    return config


def _hf_tensors(reader: gguf.GGUFReader, hf_config: dict[str, Any]) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        # numpy's shape is GGUF's reversed, so a matrix arrives as (out_features, in_features) like torch's Linear.
        # np.asarray drops the memmap subclass, whose per-slice bookkeeping would dominate dequantization time.
        weights = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32, copy=False)
        name = _hf_name(tensor.name)
        if name.endswith("q_proj.weight"):
            weights = _undo_rope_permutation(weights, hf_config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weights = _undo_rope_permutation(weights, hf_config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(weights)
    return tensors


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")
    return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"


def _undo_rope_permutation(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp reorders each head's q/k rows from HF's rotate-half layout [x0..x(d/2-1), y0..] to interleaved
    pairs [x0, y0, x1, y1, ...] (reshape(heads, 2, d/2).swapaxes(1, 2)); this puts the halves back."""
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
    if pre in _LLAMA3:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    known = sorted(_DIGITS_THEN_GPT2 | _GPT2 | _LLAMA3)
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {known}")


def _build_tokenizer(metadata: dict[str, Any]) -> HFTokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF vocabularies are supported, got {kind!r}")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
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


def _special_token_and_id(metadata: dict[str, Any], key: str) -> tuple[str, int] | None:
    token = _special_token(metadata, key)
    return None if token is None else (token, metadata[f"tokenizer.ggml.{key}"])


def _special_token(metadata: dict[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else metadata["tokenizer.ggml.tokens"][token_id]


def _tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _special_token(metadata, "bos_token_id"),
        "eos_token": _special_token(metadata, "eos_token_id"),
        "unk_token": _special_token(metadata, "unknown_token_id"),
        "pad_token": _special_token(metadata, "padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata.get("llama.context_length"),
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
