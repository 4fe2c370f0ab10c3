"""Triton is optional: the kernel modules must import without it, their references must work, and
their Triton launchers must fail with an ImportError rather than something obscure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_PROGRAM = """
import sys

sys.modules["triton"] = None  # makes `import triton` raise ImportError
sys.modules["triton.language"] = None

import torch

import conveyor_kernels.activation
import conveyor_kernels.block_copy
import conveyor_kernels.decode_attention
import conveyor_kernels.fused_moe
import conveyor_kernels.kv_cache_write
import conveyor_kernels.prefill_attention
import conveyor_kernels.rmsnorm
import conveyor_kernels.rotary
import conveyor_kernels.w4a16_matmul

x = torch.randn(2, 8)
assert conveyor_kernels.activation.silu_and_mul_reference(x).shape == (2, 4)
try:
    conveyor_kernels.activation.silu_and_mul(x)
except ImportError:
    pass
else:
    raise SystemExit("a Triton launcher ran without Triton")
"""


def test_kernel_modules_import_without_triton() -> None:
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", _PROGRAM], cwd=repo_root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
