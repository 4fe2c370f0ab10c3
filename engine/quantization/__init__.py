"""Quantization methods: how a projection's weights are created, loaded and multiplied (vLLM's split of a
QuantizationConfig, which picks a method per layer, from the LinearMethod that owns the layer's weights).

A `QuantizableLinear` (engine/parallel_layers.py; `layer` below) asks the method of the model being built for
everything about its weight: `create_weights` makes its parameters, `load_weight` puts a checkpoint tensor's rows of one part (q, k or v;
gate or up) in place, `process_weights_after_loading` turns what was loaded into the layout the matmul reads (a
oneDNN-packed bf16 copy, int8 groups...), and `apply` is the matmul. One method per module:

- unquantized.py: the checkpoint's float weights, torch's matmul (oneDNN-packed for bf16 on CPU): today's path.
- gguf.py: a GGUF file's quantized blocks kept as they are, multiplied by kernels/quantized_matmul.
- weight_only.py: int8 / int4 groups quantized at load time from a float checkpoint, the same kernels.
- w4a16.py: an AWQ or GPTQ checkpoint's 4-bit groups with zero points, repacked 4-bit for the CPU kernels or the
  Triton W4A16 GEMM (kernels/w4a16_matmul.py).
- fp8.py: an FP8 checkpoint's float8 weights (per-tensor / per-channel scales), W8A8 by torch._scaled_mm on CUDA,
  dequantized on the fly elsewhere.

Checkpoints that store a projection as several tensors (AWQ / GPTQ's qweight, qzeros, scales; FP8's weight and
weight_scale) are gathered into one tensor per projection by the method's `wrap_checkpoint`, which
engine/loader.py applies to the checkpoint's tensors.

Embeddings, norms, MoE experts and routers stay unquantized: a quantized checkpoint tensor headed there is
dequantized (exactly) as it is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from engine.checkpoint import CheckpointTensor
from engine.config import QuantizationConfig


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


_building: LinearMethod | None = None


@contextmanager
def building_quantized(quantization: QuantizationConfig | None) -> Iterator[None]:
    """Projections constructed inside take the method of `quantization` (None: unquantized)."""
    global _building
    previous, _building = _building, linear_method(quantization)
    try:
        yield
    finally:
        _building = previous


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
        "gguf": lambda q: GGUFLinearMethod(),
        "int8": lambda q: WeightOnlyLinearMethod(8, q.group_size),
        "int4": lambda q: WeightOnlyLinearMethod(4, q.group_size),
        "awq": lambda q: W4A16LinearMethod(q.group_size),
        "gptq": lambda q: W4A16LinearMethod(q.group_size),
        "fp8": lambda q: Fp8LinearMethod(dynamic_activations=q.activation_scheme == "dynamic"),
    }
    return methods[quantization.method](quantization)
