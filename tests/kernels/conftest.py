"""Kernel tests run the Triton kernels against their torch references.

Without a GPU they go through Triton's CPU interpreter. TRITON_INTERPRET has to be set before any
kernel module is imported: `@triton.jit` decides between compiling and interpreting when the
kernel is defined.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled  # noqa: E402

_needs_triton = pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed")


@pytest.fixture(
    params=[
        pytest.param(
            "cpu",
            marks=[
                _needs_triton,
                pytest.mark.skipif(not interpreter_enabled(), reason="CPU tensors need TRITON_INTERPRET=1"),
            ],
        ),
        pytest.param(
            "cuda",
            marks=[
                _needs_triton,
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
            ],
        ),
    ]
)
def device(request: pytest.FixtureRequest) -> str:
    """Where a Triton kernel runs: CPU tensors under the interpreter, or a real GPU."""
    return request.param
