"""Grouped LoRA, the Punica/S-LoRA shape: each token row of a step adds its own adapter's low-rank term to a shared
base projection, `out[t] += (x[t] @ A[s].T) @ B[s].T` with s = `token_slots[t]` (-1: the base model, nothing added).
`A` is [slots, R, in] and `B` [slots, out, R], one slot per resident adapter, its scale folded into B; two launches
(shrink to R, expand from R) whatever the mix of adapters in the step. On the CPU `lora_add_cpu` (lora_cpu.cpp) does
both in one call, one pass per row over its slot's weights, skipping the zero-padded ranks and the zero blocks of a
fused projection's block-diagonal B; `lora_add_reference` is the oracle of both."""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from conveyor_kernels.cpu_kernels import build_digest, load_extension, march_flag
from conveyor_kernels.triton_utils import require_triton, tl, triton

log = logging.getLogger(__name__)

_CPU_SOURCE = Path(__file__).with_name("lora_cpu.cpp")


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, y_ptr,
    in_features, rank,
    x_stride, a_stride_slot, a_stride_rank, y_stride,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (token, rank block): y[t, r] = sum_k x[t, k] * A[s, r, k] in float32; zero for base rows."""
    token = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + token)
    # A base row reads nothing: its columns end at 0 (a bound, as masks take no scalar conditions)
    columns = tl.where(slot >= 0, in_features, 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * x_stride + cols, mask=cols < columns, other=0.0).to(tl.float32)
        a_mask = (ranks[:, None] < rank) & (cols[None, :] < columns)
        a = tl.load(
            a_ptr + slot * a_stride_slot + ranks[:, None] * a_stride_rank + cols[None, :], mask=a_mask, other=0.0
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(y_ptr + token * y_stride + ranks, acc, mask=ranks < rank)


@triton.jit
def _lora_expand_kernel(
    y_ptr, b_ptr, slots_ptr, out_ptr,
    out_features, rank,
    y_stride, b_stride_slot, b_stride_out, b_stride_rank, out_stride,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Program (token, output block): out[t, n] += sum_r y[t, r] * B[s, n, r]; base rows are left as they are."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + token)
    columns = tl.where(slot >= 0, out_features, 0)  # a base row writes nothing
    slot = tl.maximum(slot, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, rank, BLOCK_R):
        ranks = start + tl.arange(0, BLOCK_R)
        y = tl.load(y_ptr + token * y_stride + ranks, mask=ranks < rank, other=0.0)
        b_mask = (cols[:, None] < columns) & (ranks[None, :] < rank)
        b = tl.load(
            b_ptr + slot * b_stride_slot + cols[:, None] * b_stride_out + ranks[None, :] * b_stride_rank, mask=b_mask,
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(b * y[None, :], axis=1)
    out_mask = cols < columns
    previous = tl.load(out_ptr + token * out_stride + cols, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, (previous + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def _check(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor) -> None:
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
        raise ValueError(f"A {tuple(a.shape)} and B {tuple(b.shape)} are not [slots, R, in] and [slots, out, R]")
    if x.shape[1] != a.shape[2] or out.shape != (x.shape[0], b.shape[1]) or token_slots.shape != (x.shape[0],):
        raise ValueError(f"x {tuple(x.shape)}, out {tuple(out.shape)}, slots {tuple(token_slots.shape)} do not fit A, B")


def lora_add(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor,
    block_k: int = 128, block_n: int = 128, block_r: int | None = None,
) -> None:
    """Triton launcher: adds each row's adapter term to `out` [T, out] in place. `x` [T, in], `token_slots` [T] int.
    The blocks: input features per shrink iteration, output columns per expand program, rank rows per shrink
    program and expand iteration (None: the rank's next power of two, at most 64)."""
    require_triton()
    _check(x, a, b, token_slots, out)
    if x.stride(-1) != 1 or out.stride(-1) != 1 or a.stride(-1) != 1:
        raise ValueError("the last dimension of x, out and A must be contiguous (B may be any strided view)")
    num_tokens, rank = x.shape[0], a.shape[1]
    if num_tokens == 0:
        return
    y = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r = block_r or triton.next_power_of_2(min(rank, 64))
    _lora_shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, a, token_slots, y, x.shape[1], rank, x.stride(0), a.stride(0), a.stride(1), y.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k,
    )
    _lora_expand_kernel[(num_tokens, triton.cdiv(out.shape[1], block_n))](
        y, b, token_slots, out, out.shape[1], rank, y.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        BLOCK_N=block_n, BLOCK_R=block_r,
    )


def lora_add_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """Plain torch `lora_add`, one gathered matmul pair per row (the oracle of the kernel and of the grouped path)."""
    _check(x, a, b, token_slots, out)
    rows = (token_slots >= 0).nonzero().flatten()
    slots = token_slots[rows].long()
    y = torch.bmm(a[slots].float(), x[rows].float().unsqueeze(-1))  # [rows, R, 1]
    delta = torch.bmm(b[slots].float(), y).squeeze(-1)
    out[rows] = (out[rows].float() + delta).to(out.dtype)


@cache
def load_lora_cpu_kernels() -> ModuleType | None:
    """The compiled CPU kernel, or None where it cannot be built (the engine then keeps its torch path)."""
    try:
        return load_extension(
            f"conveyor_lora_cpu_{build_digest(_CPU_SOURCE)}", "the C++ LoRA kernel", [_CPU_SOURCE],
            extra_cflags=["-O3", march_flag(), "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # any build failure means: use the torch path
        log.warning("the C++ LoRA kernel is unavailable, using the torch path: %s", error)
        return None


def lora_add_cpu(
    x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, token_slots: torch.Tensor, used: torch.Tensor,
    part_starts: list[int], out: torch.Tensor,
) -> None:
    """C++ launcher: adds each row's adapter term to `out` [T, out] in place (float32 or bfloat16). `b_t` is B
    transposed, [slots, W, out]; W = parts * R, rank row r of part r // R adds to output columns
    part_starts[r // R] .. part_starts[r // R + 1] only; `used` [slots, W] bool: the rank rows a slot's adapter fills
    (the others are zero and skipped); `token_slots` [T] int32."""
    module = load_lora_cpu_kernels()
    if module is None:
        raise RuntimeError("the C++ LoRA kernel could not be built (see the log)")
    part_rank = a.shape[1] // (len(part_starts) - 1)
    module.lora_add(x, a, b_t, token_slots, used, part_starts, part_rank, out)
