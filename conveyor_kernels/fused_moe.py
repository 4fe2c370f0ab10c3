"""Mixture-of-experts feed-forward over stacked expert weights, for a batch of routed tokens:

    out[t] = sum_j weight[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]),   e = expert[t, j]

with `gate_up` [E, 2 * I, H] (gate rows first, as transformers 5 stacks them) and `down` [E, H, I]. Each
(token, j) pair is a *slot*, numbered t * top_k + j. Three implementations of the one function:

- `fused_moe`, Triton (the CUDA path, as vLLM's fused_moe is shaped): the slots are sorted by expert and
  each expert's run padded to a multiple of BLOCK_M (`align_slots_to_experts`), so every tile of rows
  belongs to one expert. One launch computes the gate/up matmul of every expert over its rows, the
  SiLU-and-mul kernel runs over all slots, and a second launch computes the down matmul, scaled by each
  slot's routing weight; the sum over j finishes in torch. Experts without tokens get no tile.
- `grouped_moe`, plain torch (the CPU path): slots sorted by expert, torch's grouped matmul (one matmul
  per expert that has slots, over its contiguous rows, in one call: no Python loop) for gate/up and for
  down, then a weighted `index_add_` back onto the tokens.
- `fused_moe_reference`: every slot's expert weights gathered, in float32; the tests' oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor_kernels.activation import silu_and_mul
from conveyor_kernels.triton_utils import dot_in_fp32, interpreter_enabled, matmul, require_triton, tl, triton


@dataclass(frozen=True)
class ExpertAlignment:
    """Slots grouped by expert, each expert's run padded to a multiple of `block_m` rows."""

    sorted_slots: torch.Tensor  # [rows] int32: the slot of each row; padding rows hold num_slots
    block_experts: torch.Tensor  # [rows / block_m] int32: the expert of each block of rows; num_experts: unused
    block_m: int


def align_slots_to_experts(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort the slots of `expert_ids` [T, top_k] by expert, in torch ops that never wait for the device (so a
    CUDA graph can hold them): the row count is the bound `slots + active experts * (block_m - 1)`, and the
    blocks past the last expert's run are marked unused rather than cut off."""
    slots = expert_ids.flatten().long()
    num_slots = slots.numel()
    device = slots.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, slots, torch.ones_like(slots))
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = padded.cumsum(0)
    order = torch.argsort(slots, stable=True)
    expert_of_row = slots[order]
    rank_in_expert = torch.arange(num_slots, device=device) - (counts.cumsum(0) - counts)[expert_of_row]
    destination = (run_ends - padded)[expert_of_row] + rank_in_expert
    max_rows = num_slots + min(num_experts, num_slots) * (block_m - 1)
    max_rows = -(-max_rows // block_m) * block_m
    sorted_slots = torch.full((max_rows,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[destination] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_experts = torch.searchsorted(run_ends, block_starts, right=True).to(torch.int32)
    return ExpertAlignment(sorted_slots, block_experts, block_m)


@triton.jit(do_not_specialize=["num_slots"])  # tokens x top_k changes every step: one compile for all
def _expert_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    slot_weights_ptr,
    sorted_slots_ptr,
    block_experts_ptr,
    num_slots,
    num_experts,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    SLOTS_PER_A_ROW: tl.constexpr,
    SCALE_BY_WEIGHT: tl.constexpr,
    IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (row block, column block): C[slot, cols] = A[slot // SLOTS_PER_A_ROW] @ B[expert, cols]^T
    for the BLOCK_M sorted rows of one expert (times each slot's routing weight with SCALE_BY_WEIGHT).
    A and B are contiguous along K; C along N."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert >= num_experts:  # past the last expert's run
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    a_rows = (slots // SLOTS_PER_A_ROW).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    b_expert = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = k_start + ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k_start + ks)[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_expert + cols[None, :] * stride_bn + (k_start + ks)[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc += matmul(a, b, IN_FP32)
    if SCALE_BY_WEIGHT:
        acc = acc * tl.load(slot_weights_ptr + slots, mask=valid, other=0.0)[:, None]
    c_offsets = slots.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptr + c_offsets, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


def _launch_expert_matmul(
    a: torch.Tensor,  # [rows of A, K]
    weights: torch.Tensor,  # [E, N, K]
    out: torch.Tensor,  # [num_slots, N]
    alignment: ExpertAlignment,
    slots_per_a_row: int,
    slot_weights: torch.Tensor | None,  # [num_slots] float32: scales each slot's row when given
) -> None:
    num_experts, n, k = weights.shape
    block_n, block_k = (32, 32) if interpreter_enabled() else (64, 64)
    grid = (alignment.block_experts.numel(), triton.cdiv(n, block_n))
    _expert_matmul_kernel[grid](
        a, weights, out, slot_weights if slot_weights is not None else out, alignment.sorted_slots,
        alignment.block_experts, out.shape[0], num_experts, n, k, a.stride(0), weights.stride(0), weights.stride(1),
        out.stride(0), SLOTS_PER_A_ROW=slots_per_a_row, SCALE_BY_WEIGHT=slot_weights is not None,
        IN_FP32=dot_in_fp32(a.dtype), BLOCK_M=alignment.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )


def _check_shapes(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    num_experts, doubled, hidden = gate_up.shape
    if x.shape[1] != hidden or down.shape != (num_experts, hidden, doubled // 2):
        raise ValueError(f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} disagree")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} need [T, top_k]")


def fused_moe(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2 * I, H]
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float32
    topk_ids: torch.Tensor,  # [T, top_k] integer expert ids
) -> torch.Tensor:  # [T, H] in x's dtype
    """Triton launcher: two expert-grouped matmul launches around one SiLU-and-mul."""
    require_triton()
    _check_shapes(x, gate_up, down, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return x.new_zeros(x.shape)
    if x.stride(1) != 1 or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("x, gate_up and down must be contiguous along their last dimension")
    num_slots = num_tokens * top_k
    num_experts = gate_up.shape[0]
    # Small row blocks while the average expert holds few slots (decode), so less of each tile is padding.
    block_m = 16 if interpreter_enabled() or num_slots <= 16 * num_experts else 64
    alignment = align_slots_to_experts(topk_ids, num_experts, block_m)
    gate_up_out = x.new_empty(num_slots, gate_up.shape[1])
    _launch_expert_matmul(x, gate_up, gate_up_out, alignment, top_k, None)
    hidden = silu_and_mul(gate_up_out)
    down_out = x.new_empty(num_slots, down.shape[1])
    _launch_expert_matmul(hidden, down, down_out, alignment, 1, topk_weights.float().flatten().contiguous())
    return down_out.view(num_tokens, top_k, -1).sum(dim=1)


def grouped_moe(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """`fused_moe` in plain torch: the slots' rows gathered in expert order, then torch's grouped matmul
    (one matmul per expert over its contiguous rows, all in one call; experts without slots cost
    nothing) for gate/up and again for down; the weighted rows are summed back onto their tokens in
    float32."""
    _check_shapes(x, gate_up, down, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    slots = topk_ids.flatten()
    order = torch.argsort(slots, stable=True)
    token_of_row = order // top_k
    group_ends = torch.bincount(slots, minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    gate, up = F.grouped_mm(x.index_select(0, token_of_row), gate_up.transpose(1, 2), offs=group_ends).chunk(2, dim=-1)
    rows_out = F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=group_ends)
    weighted = rows_out.float() * topk_weights.flatten().float()[order, None]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token_of_row, weighted).to(x.dtype)


def fused_moe_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Each slot's expert weights gathered ([T, top_k, ...] copies: small shapes only), float32 throughout."""
    _check_shapes(x, gate_up, down, topk_weights, topk_ids)
    ids = topk_ids.long()
    gate, up = torch.einsum("th,tknh->tkn", x.float(), gate_up.float()[ids]).chunk(2, dim=-1)
    expert_out = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, down.float()[ids])
    return (expert_out * topk_weights.float()[..., None]).sum(dim=1).to(x.dtype)
