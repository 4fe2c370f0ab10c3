"""Triton grouped LoRA (shrink, expand) against its torch reference, and the reference against the formula."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.lora import load_lora_cpu_kernels, lora_add, lora_add_cpu, lora_add_reference
from tests.kernels.kernel_testing import DTYPES, tolerance


def _case(num_tokens: int, in_features: int, out_features: int, rank: int, num_slots: int, dtype, device):
    generator = torch.Generator().manual_seed(num_tokens + rank)
    x = torch.randn(num_tokens, in_features, generator=generator).to(device, dtype)
    a = (0.3 * torch.randn(num_slots, rank, in_features, generator=generator)).to(device, dtype)
    b = (0.3 * torch.randn(num_slots, out_features, rank, generator=generator)).to(device, dtype)
    # Rows of every slot and of the base model (-1), mixed in no order
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=generator).to(device, torch.int32)
    base = torch.randn(num_tokens, out_features, generator=generator).to(device, dtype)
    return x, a, b, slots, base


@pytest.mark.parametrize(("num_tokens", "in_features", "out_features", "rank", "num_slots"),
                         [(1, 32, 48, 8, 1), (7, 40, 24, 16, 3), (12, 64, 100, 12, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed_b", [False, True], ids=["b_contiguous", "b_transposed"])
def test_lora_add_matches_reference(
    device, dtype, transposed_b, num_tokens, in_features, out_features, rank, num_slots
) -> None:
    x, a, b, slots, base = _case(num_tokens, in_features, out_features, rank, num_slots, dtype, device)
    if transposed_b:  # B as the engine keeps it: a [slots, out, R] view of [slots, R, out]
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    out, expected = base.clone(), base.clone()
    lora_add(x, a, b, slots, out, block_k=16, block_n=16, block_r=8)  # small blocks: every loop crosses several
    lora_add_reference(x, a, b, slots, expected)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    base_rows = slots < 0
    assert torch.equal(out[base_rows], base[base_rows])  # the base model's rows are left untouched


def test_reference_matches_the_formula() -> None:
    x, a, b, slots, base = _case(6, 16, 8, 4, 2, torch.float32, "cpu")
    out = base.clone()
    lora_add_reference(x, a, b, slots, out)
    for row, slot in enumerate(slots.tolist()):
        expected = base[row] if slot < 0 else base[row] + b[slot].double() @ (a[slot].double() @ x[row].double())
        torch.testing.assert_close(out[row].double(), expected.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernel_matches_reference(dtype) -> None:
    """The C++ kernel on a fused projection's layout (three parts of rank 4, B block-diagonal): slots filling part of
    their ranks and parts (`used`), rows of every slot and of the base model."""
    if load_lora_cpu_kernels() is None:
        pytest.skip("the C++ LoRA kernel cannot be built here")
    generator = torch.Generator().manual_seed(5)
    part_sizes, rank, in_features = [12, 6, 6], 4, 20
    width, starts = len(part_sizes) * rank, [0, 12, 18, 24]
    used = torch.rand(3, width, generator=generator) > 0.3
    a = torch.randn(3, width, in_features, generator=generator) * used.unsqueeze(-1)
    b_t = torch.randn(3, width, starts[-1], generator=generator) * used.unsqueeze(-1)
    for part in range(len(part_sizes)):  # each part's rank rows expand into its own columns only
        outside = torch.ones(starts[-1], dtype=torch.bool)
        outside[starts[part] : starts[part + 1]] = False
        b_t[:, part * rank : (part + 1) * rank, outside] = 0
    x = torch.randn(9, in_features, generator=generator).to(dtype)
    slots = torch.tensor([0, -1, 2, 1, 1, 0, -1, 2, 2], dtype=torch.int32)
    base = torch.randn(9, starts[-1], generator=generator).to(dtype)
    a, b_t = a.to(dtype), b_t.to(dtype)
    out, expected = base.clone(), base.clone()
    lora_add_cpu(x, a, b_t, slots, used, starts, out)
    lora_add_reference(x, a, b_t.transpose(1, 2), slots, expected)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    assert torch.equal(out[slots < 0], base[slots < 0])
