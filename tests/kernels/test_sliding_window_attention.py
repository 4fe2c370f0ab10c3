"""Sliding-window and soft-capped attention in every backend (torch reference, C++ CPU decode, Triton
decode and prefill) against the naive float64 oracle. The block-table entries of blocks wholly before
every query's window are set to -1, as the block manager leaves them once it has freed those blocks:
a backend that reads one fails (torch's index_select rejects it; a kernel reads garbage)."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.cpu_kernels import load_cpu_kernels, paged_decode_attention
from conveyor_kernels.decode_attention import decode_attention
from conveyor_kernels.paged_attention import paged_attention_reference, plan_paged_attention
from conveyor_kernels.prefill_attention import prefill_attention
from tests.kernels.kernel_testing import make_paged_kv, naive_attention, poisoned

WINDOW = 20
# (cached prefix, new tokens): chunks shorter and longer than the window, starting inside and past it,
# decode rows before the window fills and long after.
CHUNKS = [(0, 45), (30, 12), (0, 7), (50, 1), (3, 1), (19, 1), (64, 1), (33, 9)]
BLOCK_SIZE = 8
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _case(chunks: list[tuple[int, int]], dtype: torch.dtype = torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [prefix + q_len for prefix, q_len in chunks]
    paged = make_paged_kv(seq_lens, KV_HEADS, HEAD_DIM, dtype, "cpu", generator, BLOCK_SIZE)
    for row, (prefix, _) in enumerate(chunks):
        freed = max(0, prefix - WINDOW + 1) // BLOCK_SIZE  # blocks no query of this chunk attends
        paged.block_tables[row, :freed] = -1
    starts = [0]
    for _, q_len in chunks:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=generator).to(dtype)
    return paged, starts, q


def _oracle(paged, starts, q, scale: float, softcap: float | None) -> torch.Tensor:
    return torch.cat([
        naive_attention(q[starts[i] : starts[i + 1]], paged.dense_k[i], paged.dense_v[i], scale, WINDOW, softcap)
        for i in range(len(starts) - 1)
    ])


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_torch_reference_windows_and_caps(softcap):
    paged, starts, q = _case(CHUNKS)
    scale = 0.4  # large scores, so the cap matters
    out = paged_attention_reference(
        q, paged.k_cache, paged.v_cache, starts, paged.seq_lens.tolist(), paged.block_tables, scale,
        window=WINDOW, softcap=softcap,
    )
    torch.testing.assert_close(out.double(), _oracle(paged, starts, q, scale, softcap), atol=1e-5, rtol=1e-5)


def test_window_plans_no_shared_prefix_groups():
    """Rows sharing blocks share no attended prefix once a window cuts it: no groups are formed."""
    tables = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 4]], dtype=torch.int32)
    plan = plan_paged_attention([0, 1, 2], [30, 30], tables, 8, shared_prefix_min_saved_tokens=1, window=WINDOW)
    assert plan.shared_prefix_groups == () and sum(g.token_index.numel() for g in plan.decode_groups) == 2


# A string condition: evaluated when the test runs, so collecting builds no C++ kernels.
@pytest.mark.skipif("load_cpu_kernels() is None", reason="the CPU kernels could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_cpu_decode_kernel_windows_and_caps(dtype, softcap):
    chunks = [(prefix, 1) for prefix in (0, 3, 19, 20, 21, 50, 64, 99)]
    paged, starts, q = _case(chunks, dtype)
    out = torch.zeros_like(q)
    paged_decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, torch.arange(len(chunks)), 0.4, out,
        window=WINDOW, softcap=softcap,
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _oracle(paged, starts, q, 0.4, softcap), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_triton_decode_windows_and_caps(device, num_splits, softcap):
    chunks = [(prefix, 1) for prefix in (0, 3, 19, 20, 21, 50, 64, 99)]
    paged, starts, q = _case(chunks)
    out = decode_attention(
        q.to(device), paged.k_cache.to(device), paged.v_cache.to(device), paged.block_tables.to(device),
        paged.seq_lens.to(device), 0.4, out=poisoned(tuple(q.shape), q.dtype, device), num_splits=num_splits,
        window=WINDOW, softcap=softcap,
    )
    torch.testing.assert_close(out.cpu().double(), _oracle(paged, starts, q, 0.4, softcap), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_triton_prefill_windows_and_caps(device, softcap):
    paged, starts, q = _case(CHUNKS)
    out = prefill_attention(
        q.to(device), paged.k_cache.to(device), paged.v_cache.to(device),
        torch.tensor(starts, dtype=torch.int32, device=device), paged.seq_lens.to(device),
        paged.block_tables.to(device), 0.4, max(q_len for _, q_len in CHUNKS),
        out=poisoned(tuple(q.shape), q.dtype, device), window=WINDOW, softcap=softcap,
    )
    torch.testing.assert_close(out.cpu().double(), _oracle(paged, starts, q, 0.4, softcap), atol=1e-4, rtol=1e-4)
