"""SiLU-and-mul, the gated activation of a SwiGLU MLP: silu(gate) * up from the fused gate/up
projection `[T, 2 * I]` (gate first). Computed in float32 and rounded once to the input dtype."""

from __future__ import annotations

import torch

from conveyor_kernels.triton_utils import interpreter_enabled, require_triton, tl, triton


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    intermediate_size,
    x_stride,
    out_stride,
    BLOCK: tl.constexpr,
):
    """Program (token, column block)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + token * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * x_stride + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + token * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I]
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:
    """Triton launcher."""
    require_triton()
    num_tokens, doubled = x.shape
    if doubled % 2 != 0:
        raise ValueError(f"last dim {doubled} is not 2 * intermediate_size")
    intermediate_size = doubled // 2
    if out is None:
        out = x.new_empty(num_tokens, intermediate_size)
    if out.shape != (num_tokens, intermediate_size):
        raise ValueError(f"out {tuple(out.shape)} should be {(num_tokens, intermediate_size)}")
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the feature dimension of x and out must be contiguous")
    if num_tokens == 0:
        return out
    # Small blocks under the interpreter so tests exercise several column blocks per row.
    block = 64 if interpreter_enabled() else 1024
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate_size, block))](
        x, out, intermediate_size, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch `silu_and_mul`."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
