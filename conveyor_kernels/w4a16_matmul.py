"""W4A16 GEMM (the CUDA path of AWQ / GPTQ checkpoints, engine/quantization/w4a16.py): x [M, K] in bf16 / fp16 /
float32 times 4-bit weights with a zero point and a scale per group of `group_size` input features,

    out[m, n] = sum_k x[m, k] * (q[n, k] - zeros[k // group_size, n]) * scales[k // group_size, n]

The weight layout (`pack`): `qweight` int32 [K / 8, N], eight input features per int32 in order (nibble j of row i
is feature 8i + j: GPTQ's packing, so each column of a tile of K reads whole int32s), `zeros` uint8 [K / group, N]
(0..16), `scales` float32 [K / group, N]. Each weight is dequantized in float32, exactly (q - z) * s, then cast to
x's dtype for the tensor-core product (so a bf16 run multiplies by the very bf16 values of the dequantized
weight), accumulated in float32.

`w4a16_matmul_reference`: dequantize in float32, matmul in float32; the tests' oracle.
"""

from __future__ import annotations

import torch

from conveyor_kernels.triton_utils import dot_in_fp32, interpreter_enabled, matmul, require_triton, tl, triton


def pack(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, zeros, scales) of this kernel from unpacked q uint8 [N, K] (0..15), zeros [N, groups] and scales
    [N, groups] (groups contiguous along K)."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"the W4A16 GEMM packs 8 input features per int32; {k} is not a multiple of 8")
    shifts = torch.arange(8, dtype=torch.int32) * 4
    nibbles = q.T.reshape(k // 8, 8, n).to(torch.int32) << shifts.view(1, 8, 1)
    qweight = _or_reduce(nibbles)
    return qweight.contiguous(), zeros.T.to(torch.uint8).contiguous(), scales.T.float().contiguous()


def _or_reduce(nibbles: torch.Tensor) -> torch.Tensor:
    """OR over axis 1 of disjoint bit fields (int32 [rows, 8, cols] -> [rows, cols])."""
    packed = nibbles[:, 0]
    for j in range(1, 8):
        packed = packed | nibbles[:, j]
    return packed


def dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [N, K] weight of the packed layout: (q - z) * s."""
    shifts = torch.arange(8, dtype=torch.int32, device=qweight.device) * 4
    q = ((qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(-1, qweight.shape[1])  # [K, N]
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    return ((q.float() - zeros[groups].float()) * scales[groups]).T


def w4a16_matmul_reference(
    x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] @ dequantize(...).T in float32 -> [M, N] float32."""
    return x.float() @ dequantize(qweight, zeros, scales, group_size).T


@triton.jit
def _w4a16_kernel(
    x_ptr,
    qweight_ptr,
    zeros_ptr,
    scales_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_om,
    IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wk_mask = k_mask[:, None] & n_mask[None, :]
        packed = tl.load(qweight_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=wk_mask, other=0)
        q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF
        group_offsets = (offs_k // group_size)[:, None] * N + offs_n[None, :]
        zero = tl.load(zeros_ptr + group_offsets, mask=wk_mask, other=0)
        scale = tl.load(scales_ptr + group_offsets, mask=wk_mask, other=0.0)
        w = (q.to(tl.int32) - zero.to(tl.int32)).to(tl.float32) * scale  # [BLOCK_K, BLOCK_N], exact
        acc += matmul(x, w.to(x.dtype), IN_FP32)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def w4a16_matmul(
    x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] @ dequantize(qweight, zeros, scales).T -> [M, N] in x's dtype (Triton)."""
    require_triton()
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x has {k} input features, the weight {qweight.shape[0] * 8}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    small = interpreter_enabled()  # small tiles keep the interpreter quick
    block_m = 16 if small or m <= 16 else 64
    block_n = 16 if small else 64
    block_k = 32 if small else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x, qweight, zeros, scales, out, m, n, k, group_size, x.stride(0), out.stride(0),
        IN_FP32=dot_in_fp32(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, for a layer."""
    out = w4a16_matmul(x.reshape(-1, x.shape[-1]), qweight, zeros, scales, group_size)
    return out.reshape(*x.shape[:-1], out.shape[-1])
