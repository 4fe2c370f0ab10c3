"""RMSNorm, alone or fused with the residual add that precedes it in a pre-norm decoder.

Rounding follows Hugging Face's Llama: the residual sum is rounded to the input dtype (it is the
residual stream), the normalization runs in float32, and the normalized row is rounded to the
input dtype before the weight multiplies it, that product rounded once more.
"""

from __future__ import annotations

import torch

from conveyor_kernels.triton_utils import next_power_of_2, require_triton, tl, triton


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    hidden_size,
    x_stride,
    residual_stride,
    out_stride,
    residual_out_stride,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One program per row. Each row is read whole before anything is written, so `out` may be
    `x` and `residual_out` may be `residual` (in-place update)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, x, mask=mask)
    x = x.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden_size + eps)
    normed = (x * inverse_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(tensor: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """[rows, hidden_size] view (a copy only if the leading dims cannot be merged)."""
    rows = tensor.reshape(-1, hidden_size)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    require_triton()
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden_size}")
    for name, tensor in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if tensor is not None and tensor.shape != x.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} does not match x {tuple(x.shape)}")
    x_rows = _rows(x, hidden_size)
    num_rows = x_rows.shape[0]
    if num_rows == 0:
        return
    out_rows = out.view(-1, hidden_size)
    residual_rows = _rows(residual, hidden_size) if residual is not None else x_rows
    residual_out_rows = residual_out.view(-1, hidden_size) if residual_out is not None else out_rows
    block = next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        x_rows,
        residual_rows,
        weight,
        out_rows,
        residual_out_rows,
        eps,
        hidden_size,
        x_rows.stride(0),
        residual_rows.stride(0),
        out_rows.stride(0),
        residual_out_rows.stride(0),
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 512)),
    )


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    out: torch.Tensor | None = None,  # like x, contiguous; may be x itself
) -> torch.Tensor:
    """Triton launcher: weight * x / sqrt(mean(x^2) + eps), in x's dtype."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # like x
    weight: torch.Tensor,  # [hidden]
    eps: float,
    out: torch.Tensor | None = None,  # like x, contiguous; may be x itself
    residual_out: torch.Tensor | None = None,  # like x, contiguous; may be residual itself
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher: (rms_norm(x + residual), x + residual) in one pass over memory. Passing
    out=x and residual_out=residual updates both in place, as a decoder layer loop wants."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if residual_out is None:
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-torch `rms_norm`."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `fused_add_rms_norm`."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(summed, weight, eps), summed
