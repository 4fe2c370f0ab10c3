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
This module writes the folder; the metadata becomes `config.json` in engine/gguf_config.py, the tensors
`model.safetensors` in engine/gguf_tensors.py and the vocabulary `tokenizer.json` in engine/gguf_tokenizer.py.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import gguf
from safetensors.torch import save_file

from engine.gguf_config import build_hf_config
from engine.gguf_tensors import ARCHITECTURES, hf_tensors
from engine.gguf_tokenizer import build_tokenizer, tokenizer_config

log = logging.getLogger(__name__)

# Bump whenever a conversion's output changes: converted folders are cached under names carrying it. Version 3
# keeps quantized blocks (version 2 folders hold them dequantized to bf16, under the same tensor names).
CONVERTER_VERSION = 3


def convert_gguf_to_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face folder into `out_dir` (created if missing) from `gguf_path`."""
    reader = gguf.GGUFReader(gguf_path)
    metadata = _read_metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {architecture!r} cannot be imported; supported: {sorted(ARCHITECTURES)}"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    # Said before and after, with a bar over the tensors on a terminal: a first start converts for tens of seconds.
    log.info(
        "converting %s (%d tensors) into a Hugging Face folder under %s: a one-time step per file; later starts load "
        "the converted folder", gguf_path.name, len(tensors), out_dir.parent,
    )
    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = build_hf_config(architecture, metadata, tensors)
    converted, quantized_types = hf_tensors(architecture, tensors, hf_config)
    if quantized_types:
        hf_config["quantization_config"] = {"quant_method": "gguf", "tensor_types": quantized_types}
    save_file(converted, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", hf_config)
    generation = {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config}
    _write_json(out_dir / "generation_config.json", generation)
    build_tokenizer(architecture, metadata).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(architecture, metadata))
    log.info("converted %s in %.0f s", gguf_path.name, time.monotonic() - started)


def _read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
