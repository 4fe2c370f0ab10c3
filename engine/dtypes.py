"""Which device, floating-point type and kernels the engine computes with."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Literal

import torch

from conveyor_kernels.cpu_kernels import cpu_isa_cap
from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled

KernelBackend = Literal["torch", "triton"]


BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx_ne_convert"})


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """oneDNN's bf16 kernels are fast only with bf16 instructions: AVX-512 BF16, AMX or AVX-NE-CONVERT. oneDNN
    reports bf16 "supported" on any AVX-512 core, where it emulates it several times slower than float32 (an
    Ice Lake-class Xeon with AVX-512 but no BF16: 8.3 ms vs 2.5 ms for a 64x576x1536 matmul; an AVX2-only
    EPYC: 6.7 ms vs 1.0 ms), so the CPU's own flags decide where Linux lists them; and none under a
    CONVEYOR_CPU_ISA cap (conveyor_kernels/cpu_kernels.py), which stands in for a CPU without them."""
    if cpu_isa_cap() is not None:
        return False
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    flags = _linux_cpu_flags()
    return flags is None or bool(flags & BF16_CPU_FLAGS)


def _linux_cpu_flags() -> frozenset[str] | None:
    """The first processor's flags from /proc/cpuinfo; None where there is no such file (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return None


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
    """None picks the GPU where there is one, else the CPU. A GPU named without an index gets the
    current one's, so the engine keeps its own index whatever thread later steps it."""
    resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Makes a GPU `device` the current CUDA device for the block: Triton launches, CUDA graph
    capture, events and pinned copies go to the current device, and every new thread (such as the
    engine loop's) starts on device 0. Nothing for other devices."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextlib.contextmanager
def building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Tensors created in the block without an explicit dtype or device are `dtype` on `device`
    (how nano-vllm builds its models): parameters are born in their final dtype where they will
    live. The default dtype is process-wide, so it is restored on the way out."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


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
