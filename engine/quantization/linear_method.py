"""The `LinearMethod` protocol every quantization method implements, and the method a model's projections are built
with (see this package's docstring)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from engine.checkpoint import CheckpointTensor
from engine.quantization.config import QuantizationConfig


class LinearMethod(Protocol):
    def create_weights(self, layer: nn.Module) -> None:
        """Register the layer's weight parameter(s) for its [out_features, in_features] matrix."""
        ...

    def load_weight(
        self, layer: nn.Module, tensor: CheckpointTensor, index: tuple[slice, ...], rows: slice, part: int
    ) -> int:
        """Put `tensor[index]` (this rank's piece of one checkpoint tensor) into output rows `rows` of the layer,
        as part `part` of a fused projection. Returns the weight elements it stands for."""
        ...

    def process_weights_after_loading(self, layer: nn.Module, pack_for_cpu: bool) -> None:
        """Turn the loaded weights into what `apply` reads; `pack_for_cpu`: bf16 on a CPU with fast bf16."""
        ...

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] @ weight.T (+ bias) -> [T, out_features] in x's dtype."""
        ...


class RowReadable(Protocol):
    """A method whose quantized matrix a tied embedding reads row by row (GGUF blocks, int8 / int4): the one matrix
    serves the output projection and the lookups."""

    def dequantize_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` (int64 [n]) of the layer's [out_features, in_features] matrix, dequantized."""
        ...


_building: LinearMethod | None = None
_building_quantization: QuantizationConfig | None = None


@contextmanager
def building_quantized(quantization: QuantizationConfig | None) -> Iterator[None]:
    """Projections constructed inside take the method of `quantization` (None: unquantized), and the model being
    built reads `quantization` with `current_quantization`."""
    global _building, _building_quantization
    previous = _building, _building_quantization
    _building, _building_quantization = linear_method(quantization), quantization
    try:
        yield
    finally:
        _building, _building_quantization = previous


def current_quantization() -> QuantizationConfig | None:
    return _building_quantization


def current_linear_method() -> LinearMethod:
    from engine.quantization.unquantized import UnquantizedLinearMethod

    return _building if _building is not None else UnquantizedLinearMethod()


def linear_method(quantization: QuantizationConfig | None) -> LinearMethod:
    from engine.quantization.fp8 import Fp8LinearMethod
    from engine.quantization.gguf import GGUFLinearMethod
    from engine.quantization.unquantized import UnquantizedLinearMethod
    from engine.quantization.w4a16 import W4A16LinearMethod
    from engine.quantization.weight_only import WeightOnlyLinearMethod

    if quantization is None:
        return UnquantizedLinearMethod()
    methods: dict[str, Callable[[QuantizationConfig], LinearMethod]] = {
        "gguf": lambda q: GGUFLinearMethod(q.activations),
        "int8": lambda q: WeightOnlyLinearMethod(8, q.group_size, q.activations),
        "int4": lambda q: WeightOnlyLinearMethod(4, q.group_size, q.activations),
        "awq": lambda q: W4A16LinearMethod(q.group_size, q.activations),
        "gptq": lambda q: W4A16LinearMethod(q.group_size, q.activations),
        "fp8": lambda q: Fp8LinearMethod(dynamic_activations=q.activation_scheme == "dynamic"),
    }
    return methods[quantization.method](quantization)
