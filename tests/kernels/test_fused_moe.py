"""The fused MoE Triton kernel and the grouped torch path against the gathered reference: ragged expert
loads, experts without tokens, top-1 and top-2 (and more), float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor_kernels.fused_moe import align_slots_to_experts, fused_moe, fused_moe_reference, grouped_moe
from tests.kernels.kernel_testing import DTYPES, tolerance

HIDDEN, INTERMEDIATE, EXPERTS = 48, 40, 6  # not multiples of the tiles, so the masks matter

# (tokens, top_k, expert loads): "ragged" gives expert 0 most slots, "idle" leaves experts 1, 3 and 5 without
# any, "one_token" is a decode step of one sequence
CASES = [
    pytest.param(37, 2, "ragged", id="top2_ragged"),
    pytest.param(37, 1, "ragged", id="top1_ragged"),
    pytest.param(20, 2, "idle", id="top2_idle_experts"),
    pytest.param(9, 1, "idle", id="top1_idle_experts"),
    pytest.param(1, 2, "ragged", id="top2_one_token"),
    pytest.param(11, 3, "ragged", id="top3"),
]


def make_case(num_tokens: int, top_k: int, loads: str, dtype: torch.dtype, device: str):
    generator = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) / INTERMEDIATE**0.5
    if loads == "ragged":  # skewed toward low expert ids, each token's experts distinct
        scores = torch.rand(num_tokens, EXPERTS, generator=generator) + torch.linspace(1.0, 0.0, EXPERTS)
    else:
        scores = torch.rand(num_tokens, EXPERTS, generator=generator)
        scores[:, [1, 3, 5]] = -1.0
    topk_ids = scores.topk(top_k, dim=-1).indices
    topk_weights = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), dim=-1)
    tensors = (x.to(dtype), gate_up.to(dtype), down.to(dtype), topk_weights, topk_ids)
    return tuple(t.to(device) for t in tensors)


@pytest.mark.parametrize(("num_tokens", "top_k", "loads"), CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_matches_reference(device: str, dtype: torch.dtype, num_tokens: int, top_k: int, loads: str) -> None:
    case = make_case(num_tokens, top_k, loads, dtype, device)
    torch.testing.assert_close(fused_moe(*case), fused_moe_reference(*case), **tolerance(dtype))


@pytest.mark.parametrize(("num_tokens", "top_k", "loads"), CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_moe_matches_reference(dtype: torch.dtype, num_tokens: int, top_k: int, loads: str) -> None:
    case = make_case(num_tokens, top_k, loads, dtype, "cpu")
    torch.testing.assert_close(grouped_moe(*case), fused_moe_reference(*case), **tolerance(dtype))


def test_no_tokens(device: str) -> None:
    case = make_case(0, 2, "ragged", torch.float32, device)
    assert fused_moe(*case).shape == (0, HIDDEN)
    assert grouped_moe(*[t.cpu() for t in case]).shape == (0, HIDDEN)


def test_reference_matches_a_loop_over_tokens() -> None:
    case = make_case(5, 2, "ragged", torch.float32, "cpu")
    x, gate_up, down, weights, ids = (t.double() if t.is_floating_point() else t for t in case)
    expected = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for j in range(ids.shape[1]):
            expert = ids[token, j]
            gate, up = (gate_up[expert] @ x[token]).chunk(2)
            expected[token] += weights[token, j] * (down[expert] @ (F.silu(gate) * up))
    torch.testing.assert_close(fused_moe_reference(*case).double(), expected, **tolerance(torch.float32))


def test_alignment_groups_slots_by_expert_in_padded_runs() -> None:
    expert_ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 2]])  # expert 1 idle; expert 2 holds 5 slots
    alignment = align_slots_to_experts(expert_ids, num_experts=4, block_m=4)
    slots, blocks = alignment.sorted_slots.tolist(), alignment.block_experts.tolist()
    padding = expert_ids.numel()
    # runs: expert 0 -> one block, expert 2 -> two blocks, expert 3 -> one block; then unused blocks
    assert blocks[:4] == [0, 2, 2, 3] and all(b == 4 for b in blocks[4:])
    assert slots[:4] == [1, 4, padding, padding]
    assert slots[4:12] == [0, 2, 5, 6, 7, padding, padding, padding]
    assert slots[12:16] == [3, padding, padding, padding]
    assert all(s == padding for s in slots[16:])
