"""A quantized model's configuration: which method stores its projection weights and how (`QuantizationConfig`), read
from a checkpoint's `quantization_config` per `quant_method`, or asked of an unquantized checkpoint (weight-only
int8 / int4, quantized at load time). engine/config.py's `ModelConfig` carries the checkpoint's; the methods beside
this module (engine/quantization/) run them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal


# `quantization_config.quant_method`s of a checkpoint whose weights this engine reads: "gguf", which this engine's
# own GGUF import writes (engine/gguf_import.py: the file's blocks kept as they are), AWQ / GPTQ 4-bit and FP8.
SUPPORTED_QUANTIZATION_METHODS: tuple[str, ...] = ("gguf", "awq", "gptq", "fp8", "compressed-tensors")
SUPPORTED_QUANTIZATION_FORMATS = (
    "GGUF files, blocks kept as they are; AWQ (GEMM) and GPTQ 4-bit, group size 32/64/128; FP8 float8_e4m3fn "
    "weights with per-tensor or per-channel scales, activations dynamic per token or unquantized"
)
# What `EngineConfig.quantization` may ask of an unquantized checkpoint: weights quantized at load time.
WEIGHT_ONLY_METHODS: tuple[str, ...] = ("int8", "int4")
WeightOnlyMethod = Literal["int8", "int4"]
# What `EngineConfig.quantized_activations` may ask: "int8", each token's activations quantized at run time in blocks
# of 32 input features (conveyor_kernels/quantized_matmul.py's ACTIVATION_BLOCK, one float32 scale a block) and multiplied
# with the weights' integer quants by integer dot products. Only the CPU kernels' formats do it: GGUF blocks,
# weight-only int8 / int4 and AWQ / GPTQ's 4-bit groups (FP8 has its own activation scheme, the checkpoint's).
QUANTIZED_ACTIVATIONS: tuple[str, ...] = ("int8",)
QuantizedActivations = Literal["int8"]
_INT8_ACTIVATION_METHODS = ("gguf", "int8", "int4", "awq", "gptq")


@dataclass(frozen=True)
class QuantizationConfig:
    """How a model's projection weights are stored and multiplied (engine/quantization/): GGUF blocks as the file
    has them, weight-only int8 / int4 groups quantized at load time, an AWQ / GPTQ checkpoint's 4-bit groups or an
    FP8 checkpoint's float8 weights. None where a config takes one: unquantized."""

    method: Literal["gguf", "int8", "int4", "awq", "gptq", "fp8"]
    # Weight-only and AWQ / GPTQ: input features per group of each output row (one scale each, and for AWQ / GPTQ
    # a zero point). GGUF: None (each tensor's type fixes its blocks: 32 values, 256 for the K-quants); FP8: None.
    group_size: int | None = None
    # GGUF: the file's quantized tensors by type, e.g. {"Q4_1": 210, "Q8_0": 1}; others: empty.
    tensor_types: tuple[tuple[str, int], ...] = ()
    # GPTQ: act-order (desc_act), the input features reordered by g_idx; GPTQ v1 stores zero points minus one
    # (zero_offset 1), v2 and AWQ as they are (0).
    act_order: bool = False
    zero_offset: int = 0
    # FP8: the checkpoint's quant_method ("fp8" or "compressed-tensors"), its weight scales ("tensor": one per
    # matrix, "channel": one per output row) and whether activations are quantized to fp8 per token at run time
    # ("dynamic": W8A8) or not (None: weight-only, W8A16).
    checkpoint_method: str | None = None
    weight_scales: Literal["tensor", "channel"] | None = None
    activation_scheme: Literal["dynamic"] | None = None
    # GGUF, int8 / int4, AWQ / GPTQ: "int8" when the engine config asks its activations quantized to int8 per
    # token at run time (`with_quantized_activations`); None: activations in the model's dtype (the exact path).
    activations: QuantizedActivations | None = None
    # GGUF: whether the token embedding is a quantized tensor (not F32 / F16 / BF16); others: False.
    embedding_quantized: bool = False

    @property
    def tied_output_quantized(self) -> bool:
        """Whether a tied output projection (the token embedding's matrix) runs quantized, as a projection of its
        own: from a GGUF's quantized embedding blocks (llama.cpp's way), or quantized at load like every other
        projection (int8 / int4). AWQ / GPTQ / FP8 checkpoints keep their output projection float."""
        return self.method in WEIGHT_ONLY_METHODS or self.embedding_quantized

    @property
    def bits(self) -> int | None:
        """Bits per weight value; None for GGUF (mixed per tensor: see tensor_types)."""
        return {"int8": 8, "int4": 4, "awq": 4, "gptq": 4, "fp8": 8}.get(self.method)

    @property
    def devices(self) -> tuple[str, ...]:
        """Device types with kernels for this method (int8 activations: the CPU kernels only)."""
        return ("cpu", "cuda") if self.method in ("awq", "gptq", "fp8") and self.activations is None else ("cpu",)

    def check_device(self, device_type: str) -> None:
        """Raises, naming what runs where, unless this method (and its activations) has kernels on `device_type`."""
        if device_type in self.devices:
            return
        if self.activations is not None:
            raise ValueError(
                f"quantized_activations={self.activations!r} runs on the CPU only (conveyor_kernels/quantized_matmul's "
                f"integer dot products; the CUDA paths, Triton W4A16 and FP8, do not quantize activations to int8); "
                f"device is {device_type}: leave quantized_activations unset there"
            )
        raise ValueError(
            f"quantization {self.method!r} runs on {' and '.join(self.devices)} only "
            f"(conveyor_kernels/quantized_matmul.cpp; AWQ / GPTQ / FP8 also on CUDA); device is {device_type}"
        )

    def describe(self) -> dict[str, Any]:
        """Plain data for logs and /v1/models: method, bits, group size, and what else the method has (GGUF
        tensor types, GPTQ act-order, FP8 scales and activations)."""
        described: dict[str, Any] = {"method": self.method, "bits": self.bits, "group_size": self.group_size}
        if self.tensor_types:
            described["tensor_types"] = dict(self.tensor_types)
        if self.method == "gptq":
            described["act_order"] = self.act_order
        if self.method == "fp8":
            described.update(
                checkpoint_method=self.checkpoint_method, weight_scales=self.weight_scales,
                activations="fp8 per token, dynamic" if self.activation_scheme == "dynamic" else "unquantized",
            )
        if self.activations == "int8":
            described["activations"] = "int8 per token, blocks of 32, dynamic"
        return described


def with_quantized_activations(
    quantization: QuantizationConfig | None, activations: QuantizedActivations
) -> QuantizationConfig:
    """`quantization` with its activations quantized as `activations` (a value EngineConfig has checked) asks, or a
    ValueError saying why not: the ask never goes silently unheeded."""
    if quantization is None or quantization.method not in _INT8_ACTIVATION_METHODS:
        this = "unquantized" if quantization is None else (
            f"{quantization.method}, whose activations the checkpoint's own scheme sets"
            if quantization.method == "fp8" else quantization.method
        )
        raise ValueError(
            f"quantized_activations={activations!r} applies to weights the CPU kernels run quantized: GGUF blocks, "
            f"quantization int8 / int4 (weight-only, at load) and AWQ / GPTQ 4-bit checkpoints; this model is {this}"
        )
    from conveyor_kernels.quantized_matmul import ACTIVATION_BLOCK  # torch: imported only as a model loads

    if quantization.group_size is not None and quantization.group_size % ACTIVATION_BLOCK:
        raise ValueError(
            f"quantized_activations={activations!r} needs weight groups that are whole activation blocks "
            f"({ACTIVATION_BLOCK} input features); this model's {quantization.method} group size is "
            f"{quantization.group_size}: pick a quantization_group_size that is a multiple of {ACTIVATION_BLOCK}"
        )
    return replace(quantization, activations=activations)


def weight_only_quantization(method: str, group_size: int) -> QuantizationConfig:
    if method not in WEIGHT_ONLY_METHODS:
        raise ValueError(f"quantization {method!r} is not supported; supported: {', '.join(WEIGHT_ONLY_METHODS)}")
    if group_size < 2 or group_size % 2:
        raise ValueError(f"quantization_group_size must be an even number >= 2, got {group_size}")
    return QuantizationConfig(method=method, group_size=group_size)  # type: ignore[arg-type]


def checkpoint_quantization(hf: dict[str, Any]) -> QuantizationConfig | None:
    """The checkpoint's quantization, read from its `quantization_config`. Any other method (bitsandbytes, EXL2,
    HQQ...) or variant (AWQ / GPTQ at other bits, FP8 with static activation scales...) stores weights this
    engine does not read: say so at load, naming what is supported, instead of failing on a missing tensor."""
    quantization = hf.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method") or ("bitsandbytes" if "load_in_4bit" in quantization else "unknown")
    if method not in _CHECKPOINT_METHODS:
        raise ValueError(
            f"quantized checkpoint (quantization_config.quant_method={method!r}) is not supported; supported "
            f"quantization methods: {', '.join(SUPPORTED_QUANTIZATION_METHODS)} ({SUPPORTED_QUANTIZATION_FORMATS}). "
            f"Or load the unquantized (bf16/fp16/fp32) checkpoint, optionally with quantization="
            f"{' or '.join(WEIGHT_ONLY_METHODS)} (weight-only, quantized at load)"
        )
    return _CHECKPOINT_METHODS[method](quantization)


def _gguf_quantization(quantization: dict[str, Any]) -> QuantizationConfig:
    tensor_types: dict[str, str] = quantization.get("tensor_types", {})
    counts: dict[str, int] = {}
    for tensor_type in tensor_types.values():
        counts[tensor_type] = counts.get(tensor_type, 0) + 1
    return QuantizationConfig(
        method="gguf", tensor_types=tuple(sorted(counts.items())),
        embedding_quantized="model.embed_tokens.weight" in tensor_types,
    )


def _int4_group_size(method: str, bits: Any, group_size: Any) -> int:
    if bits != 4:
        raise ValueError(f"{method} checkpoint with bits={bits} is not supported; supported: bits=4")
    if group_size not in (32, 64, 128):
        raise ValueError(f"{method} checkpoint with group_size={group_size} is not supported; supported: 32, 64, 128")
    return int(group_size)


def _awq_quantization(quantization: dict[str, Any]) -> QuantizationConfig:
    """transformers' AwqConfig ("bits", "group_size") or AutoAWQ's own keys ("w_bit", "q_group_size")."""
    bits = quantization.get("bits", quantization.get("w_bit"))
    group_size = _int4_group_size("awq", bits, quantization.get("group_size", quantization.get("q_group_size")))
    version = str(quantization.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq checkpoint of version {version!r} is not supported; supported: gemm (AutoAWQ's GEMM layout)")
    if not quantization.get("zero_point", True):
        raise ValueError("awq checkpoint without zero points (zero_point=false) is not supported; supported: zero_point=true")
    return QuantizationConfig(method="awq", group_size=group_size)


def _gptq_quantization(quantization: dict[str, Any]) -> QuantizationConfig:
    group_size = _int4_group_size("gptq", quantization.get("bits"), quantization.get("group_size"))
    checkpoint_format = quantization.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"gptq checkpoint_format {checkpoint_format!r} is not supported; supported: gptq (v1), gptq_v2"
        )
    return QuantizationConfig(
        method="gptq", group_size=group_size, act_order=bool(quantization.get("desc_act", False)),
        zero_offset=1 if checkpoint_format == "gptq" else 0,
    )


def _fp8_quantization(quantization: dict[str, Any]) -> QuantizationConfig:
    """The "fp8" quant_method: float8_e4m3fn weights with a per-tensor `weight_scale`, activations quantized
    dynamically per token (activation_scheme "dynamic")."""
    if quantization.get("weight_block_size"):
        raise ValueError(
            f"fp8 checkpoint with block-wise weight scales (weight_block_size={quantization['weight_block_size']}) "
            f"is not supported; supported: per-tensor and per-channel weight scales"
        )
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"fp8 checkpoint with activation_scheme={scheme!r} (static input scales) is not supported; supported: "
            f"dynamic (per-token activation scales)"
        )
    return QuantizationConfig(method="fp8", checkpoint_method="fp8", weight_scales="tensor", activation_scheme="dynamic")


def _compressed_tensors_quantization(quantization: dict[str, Any]) -> QuantizationConfig:
    """compressed-tensors' float8 schemes: weights float8 (8 bits, type float) with per-tensor or per-channel
    scales, activations float8 per token, dynamic, or not quantized (weight-only)."""
    schemes = list((quantization.get("config_groups") or {}).values())
    supported = (
        "compressed-tensors float8 weights (num_bits 8, type float, strategy tensor or channel, symmetric) with activations "
        "fp8 per token (dynamic, strategy token) or unquantized"
    )
    if not schemes:
        raise ValueError(f"compressed-tensors checkpoint without config_groups; supported: {supported}")
    found: set[tuple[str, bool]] = set()
    for scheme in schemes:
        weights, activations = scheme.get("weights") or {}, scheme.get("input_activations")
        if (weights.get("num_bits"), weights.get("type"), weights.get("strategy"), weights.get("symmetric", True)) not in (
            (8, "float", "tensor", True), (8, "float", "channel", True)
        ):
            raise ValueError(f"compressed-tensors weights {weights} are not supported; supported: {supported}")
        if activations is not None and (
            (activations.get("num_bits"), activations.get("type"), activations.get("strategy"), activations.get("dynamic"))
            != (8, "float", "token", True)
        ):
            raise ValueError(f"compressed-tensors input_activations {activations} are not supported; supported: {supported}")
        found.add((weights["strategy"], activations is not None))
    if len(found) != 1:
        raise ValueError(f"compressed-tensors config_groups with different schemes are not supported; supported: {supported}")
    strategy, dynamic = found.pop()
    return QuantizationConfig(
        method="fp8", checkpoint_method="compressed-tensors", weight_scales=strategy,  # type: ignore[arg-type]
        activation_scheme="dynamic" if dynamic else None,
    )


_CHECKPOINT_METHODS: dict[str, Callable[[dict[str, Any]], QuantizationConfig]] = {
    "gguf": _gguf_quantization,
    "awq": _awq_quantization,
    "gptq": _gptq_quantization,
    "fp8": _fp8_quantization,
    "compressed-tensors": _compressed_tensors_quantization,
}
