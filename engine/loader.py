"""Where a model's weights come from: a folder of safetensors files (an imported GGUF's quantized blocks among
them), or deterministic random numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.parallel_layers import CheckpointTensor
from engine.config import ModelConfig
from engine.quantization import fp8, w4a16
from engine.quantization.gguf import GGUFTensor, check_supported

DUMMY_WEIGHT_STD = 0.02  # small enough that 30+ layers of residual sums stay far inside bf16's range


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every `*.safetensors` file in `folder`, one at a time, read from a memory map."""
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as checkpoint:
            for name in checkpoint.keys():
                yield name, checkpoint.get_tensor(name)


def iter_safetensors_slices(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of every `*.safetensors` file in `folder` as a slice that reads only what is indexed
    (`slice[a:b]`, `slice[:, a:b]`): a tensor-parallel rank reads its shard, not the whole tensor. A slice is
    readable until the next one is yielded."""
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as checkpoint:
            for name in checkpoint.keys():
                yield name, checkpoint.get_slice(name)


def iter_checkpoint(folder: Path, hf_config: dict[str, Any]) -> Iterator[tuple[str, CheckpointTensor]]:
    """`iter_safetensors_slices`, with a quantized checkpoint's tensors wrapped as its method reads them: an
    imported GGUF's blocks (`with_gguf_blocks`), an AWQ / GPTQ projection's packed tensors or an FP8 projection's
    weight and scale gathered into one (engine/quantization/w4a16.py, fp8.py)."""
    tensors = with_gguf_blocks(iter_safetensors_slices(folder), hf_config)
    quantization = ModelConfig.from_hf(hf_config).quantization if hf_config.get("quantization_config") else None
    if quantization is None:
        return tensors
    wrappers: dict[str, Callable[[], Iterator[tuple[str, CheckpointTensor]]]] = {
        "awq": lambda: w4a16.wrap_checkpoint(tensors, "awq", quantization.group_size, quantization.zero_offset),
        "gptq": lambda: w4a16.wrap_checkpoint(tensors, "gptq", quantization.group_size, quantization.zero_offset),
        "fp8": lambda: fp8.wrap_checkpoint(tensors),
    }
    return wrappers[quantization.method]() if quantization.method in wrappers else tensors


def with_gguf_blocks(
    named_tensors: Iterable[tuple[str, CheckpointTensor]], hf_config: dict[str, Any]
) -> Iterator[tuple[str, CheckpointTensor]]:
    """The tensors an imported GGUF keeps as blocks (config.json's `quantization_config.tensor_types`,
    engine/gguf_import.py) wrapped as `GGUFTensor`s of their type; the others as they are."""
    quantization = hf_config.get("quantization_config") or {}
    tensor_types: dict[str, str] = quantization.get("tensor_types", {}) if quantization.get("quant_method") == "gguf" else {}
    for name, tensor in named_tensors:
        if name in tensor_types:
            check_supported(tensor_types[name], name)
            yield name, GGUFTensor(tensor, tensor_types[name])
        else:
            yield name, tensor


def _safetensors_files(folder: Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill `model` with N(0, 0.02) matrices and embeddings, 1.0 norm weights and zero biases.

    Numbers are drawn on each parameter's own device (fast for multi-billion-parameter shapes), so a seed gives
    the same weights on every run on the same kind of device.
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim >= 2:
                if parameter.device not in generators:
                    generators[parameter.device] = torch.Generator(device=parameter.device).manual_seed(seed)
                parameter.normal_(0.0, DUMMY_WEIGHT_STD, generator=generators[parameter.device])
            elif name.endswith("bias"):
                parameter.zero_()
            else:  # a 1-D weight in these models is a norm's scale
                parameter.fill_(1.0)
