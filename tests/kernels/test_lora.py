"""Triton grouped LoRA (shrink, expand) against its torch reference, and the reference against the formula."""

from __future__ import annotations

import pytest
import torch

from kernels.lora import lora_add, lora_add_reference
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
    lora_add(x, a, b, slots, out)
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
