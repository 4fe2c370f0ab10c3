"""Shared fixtures: the real SmolLM2 (converted once per cache dir) and tiny random HF checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest_plugins = ["tests.service_fixtures", "tests.stack_fixtures"]

# Triton decides between compiling and interpreting when a kernel module is imported, and engine
# tests import kernels first: without a GPU, interpret.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    from engine.model_registry import DEFAULT_MODEL, resolve_model

    source = resolve_model(DEFAULT_MODEL)
    assert source.path is not None
    return source.path


@pytest.fixture
def tiny_dummy_model(tmp_path: Path) -> Path:
    """A config-only folder of a tiny Qwen3 (q/k norms, explicit head_dim), for load_format="dummy"."""
    import json

    config = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def save_random_hf_model(kind: str, folder: Path) -> Path:
    """A small random Llama, Qwen2 or Qwen3 checkpoint saved by transformers itself (the oracle's own format)."""
    import transformers

    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model_cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":  # q/k/v projections with bias
        config = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        model_cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = model_cls(config).float()
    with torch.no_grad():  # peaked logits: greedy decisions should not hinge on float rounding
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
