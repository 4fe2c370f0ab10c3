"""Which device, floating-point type and kernels the engine computes with."""

from __future__ import annotations

from typing import Literal

import torch

from kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled

KernelBackend = Literal["torch", "triton"]


def cpu_has_fast_bf16() -> bool:
    """oneDNN's bf16 kernels need AVX-512 (BF16/AMX) or AVX-NE-CONVERT; elsewhere bf16 is emulated, several times
    slower than float32 (an AVX2-only EPYC: 6.7 ms vs 1.0 ms for a 64x576x1536 matmul)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' picks bfloat16 where it is fast (recent GPUs, CPUs with AVX-512 BF16 or AMX), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type != "cpu" or cpu_has_fast_bf16() else torch.float32
    names = { "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None picks the GPU where there is one, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_kernel_backend(choice: Literal["auto", "torch", "triton"], device: torch.device) -> KernelBackend:
    """'auto' picks Triton on CUDA (when it is installed) and torch elsewhere. Triton on the CPU
    runs only under its interpreter (TRITON_INTERPRET=1), which is for tests: it is very slow."""
    if choice == "auto":
        return "triton" if device.type == "cuda" and TRITON_AVAILABLE else "torch"
    if choice == "torch":
        return "torch"
    if not TRITON_AVAILABLE:
        raise ValueError("kernel_backend='triton' needs Triton: pip install 'conveyor[triton]'")
    if device.type == "cpu" and not interpreter_enabled():
        raise ValueError("kernel_backend='triton' on the CPU needs TRITON_INTERPRET=1 (tests only)")
    return "triton"
