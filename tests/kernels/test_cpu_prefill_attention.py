"""The bf16 prefill attention kernel (AVX-512 BF16) against `paged_attention_reference` in float32, on chunks
with and without a cached prefix, lengths around its 16-key groups and 64-key spans, GQA ratios 1/3/4/8,
head_dim 32 to 256, windows, and decode rows between the chunks that it must leave alone; and over an int8 cache."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels import kv_quant
from conveyor_kernels.cpu_kernels import paged_prefill_attention, prefill_attention_available
from conveyor_kernels.paged_attention import paged_attention_reference, plan_paged_attention, run_paged_attention

# A string condition is evaluated when a test runs, not at collection: collecting builds no C++ (a GPU run's
# `pytest -m cuda` would otherwise compile the CPU kernels first).
pytestmark = pytest.mark.skipif(
    "not prefill_attention_available(torch.bfloat16, 64)", reason="needs the C++ kernels built with AVX-512 BF16"
)

# (new tokens, context length after them): whole prompts, chunks after a cached prefix, and decode rows (1 token)
ROWS = [(5, 5), (1, 40), (64, 64), (65, 65), (17, 130), (1, 7), (2, 200), (130, 130), (63, 127)]
# The float32 reference against bf16 outputs: the outputs' own rounding is about 8e-3 at these magnitudes.
TOLERANCE = 2e-2


def _batch(num_heads, num_kv_heads, head_dim, block_size, rows, seed):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in rows]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).bfloat16()
    order = torch.randperm(num_blocks, generator=generator).int()  # scattered, non-overlapping tables
    block_tables = torch.zeros(len(rows), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = order[used : used + count]
        used += count
    starts = [0]
    for new_tokens, _ in rows:
        starts.append(starts[-1] + new_tokens)
    # The queries as a strided slice of a wider fused projection, as the model hands them over.
    fused = torch.randn(starts[-1], num_heads + 2 * num_kv_heads, head_dim, generator=generator).bfloat16()
    return fused[:, :num_heads], k_cache, v_cache, block_tables, starts


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 32), (4, 2, 256)]
)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 1, 40, 64])
def test_prefill_kernel_matches_the_reference(num_heads, num_kv_heads, head_dim, block_size, window):
    query, k_cache, v_cache, block_tables, starts = _batch(
        num_heads, num_kv_heads, head_dim, block_size, ROWS, seed=head_dim + block_size
    )
    seq_lens = [seq_len for _, seq_len in ROWS]
    chunks = [i for i, (new_tokens, _) in enumerate(ROWS) if new_tokens > 1]
    if window is not None:
        # Blocks wholly before a chunk's first window are freed (-1) and must never be read.
        for i in chunks:
            first_attended = max(0, seq_lens[i] - (starts[i + 1] - starts[i]) - window + 1)
            block_tables[i, : first_attended // block_size] = -1
    scale = head_dim**-0.5
    expected = paged_attention_reference(
        query.float(), k_cache.float(), v_cache.float(), starts, seq_lens, block_tables.clamp(min=0), scale, window
    )
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    paged_prefill_attention(
        query, k_cache, v_cache, block_tables[chunks].contiguous(), torch.tensor([seq_lens[i] for i in chunks]).int(),
        torch.tensor([starts[i] for i in chunks]), torch.tensor([starts[i + 1] for i in chunks]), scale, out, window,
    )
    chunk_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chunks])
    decode_rows = torch.tensor([starts[i] for i, (new_tokens, _) in enumerate(ROWS) if new_tokens == 1])
    torch.testing.assert_close(out[chunk_rows].float(), expected[chunk_rows], atol=TOLERANCE, rtol=TOLERANCE)
    assert out[decode_rows].isnan().all(), "rows of other sequences were written"


def test_planned_kernel_path_matches_the_torch_path():
    """Through the plan, as the engine runs it: prefill chunks by the kernel, decode rows by the decode kernel."""
    query, k_cache, v_cache, block_tables, starts = _batch(9, 3, 64, 16, ROWS, seed=7)
    seq_lens = [seq_len for _, seq_len in ROWS]
    expected = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(), starts, seq_lens, block_tables, 0.125)
    plan = plan_paged_attention(starts, seq_lens, block_tables, 16, use_decode_kernel=True, use_prefill_kernel=True)
    assert plan.prefill_batch is not None and not plan.prefill_rows
    torch.testing.assert_close(
        run_paged_attention(query, k_cache, v_cache, plan, 0.125).float(), expected, atol=TOLERANCE, rtol=TOLERANCE
    )


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 40])
def test_prefill_kernel_reads_an_int8_cache_as_the_reference(num_heads, num_kv_heads, head_dim, block_size, window):
    """An int8 cache (conveyor_kernels/kv_quant.py) is packed as its rows dequantized to bf16, the values torch's bf16 path
    (the engine's before) attends: against the float32 reference over the same int8 cache, its error is that path's
    (rows of magnitudes up to 4 make peaked softmaxes, where the bf16 keys' rounding shows: up to 0.1 in both)."""
    query, k_cache, v_cache, block_tables, starts = _batch(
        num_heads, num_kv_heads, head_dim, block_size, ROWS, seed=head_dim + block_size + 1
    )
    # Rows of very different magnitudes, so a wrong row's scale shows.
    magnitude = torch.rand(*k_cache.shape[:3], 1, generator=torch.Generator().manual_seed(3)) * 4 + 0.05
    k_cache, v_cache = (kv_quant.quantize(cache.float() * magnitude, torch.int8) for cache in (k_cache, v_cache))
    seq_lens = [seq_len for _, seq_len in ROWS]
    chunks = [i for i, (new_tokens, _) in enumerate(ROWS) if new_tokens > 1]
    if window is not None:
        for i in chunks:
            first_attended = max(0, seq_lens[i] - (starts[i + 1] - starts[i]) - window + 1)
            block_tables[i, : first_attended // block_size] = -1
    scale = head_dim**-0.5
    expected = paged_attention_reference(
        query.float(), k_cache, v_cache, starts, seq_lens, block_tables.clamp(min=0), scale, window
    )
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    paged_prefill_attention(
        query, k_cache, v_cache, block_tables[chunks].contiguous(), torch.tensor([seq_lens[i] for i in chunks]).int(),
        torch.tensor([starts[i] for i in chunks]), torch.tensor([starts[i + 1] for i in chunks]), scale, out, window,
    )
    chunk_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chunks])
    torchs = paged_attention_reference(query, k_cache, v_cache, starts, seq_lens, block_tables.clamp(min=0), scale, window)
    ours, torchs = ((got[chunk_rows].float() - expected[chunk_rows]).abs() for got in (out, torchs))
    assert ours.max() <= 1.05 * torchs.max() and ours.mean() <= 1.05 * torchs.mean()
