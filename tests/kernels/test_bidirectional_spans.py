"""The torch paged attention's bidirectional spans (Gemma 3's image tokens) against a dense float64 oracle built as
transformers builds its mask: a query at p sees key k when k <= p or both lie in one span, and with a window only
k > p - window. Chunks: from the start with a span inside, two spans, one starting inside a span whose first part
is cached (a prefix-cache hit ending inside an image), beside a plain chunk and a decode row."""

from __future__ import annotations

import pytest
import torch

from conveyor_kernels.paged_attention import plan_paged_attention, run_paged_attention
from tests.kernels.kernel_testing import make_paged_kv

BLOCK_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
CHUNKS = [(0, 30), (0, 26), (12, 14), (0, 9), (40, 1)]  # (cached prefix, new tokens) per sequence
SPANS = [(0, 6, 18), (1, 2, 8), (1, 10, 22), (2, 8, 20)]  # (sequence, start, stop)


def _oracle(q, keys, values, prefix: int, spans: list[tuple[int, int]], scale: float, window: int | None):
    q_len, seq_len = q.shape[0], keys.shape[0]
    query = torch.arange(prefix, prefix + q_len)[:, None]
    key = torch.arange(seq_len)[None, :]
    mask = key <= query
    for start, stop in spans:
        mask |= (query >= start) & (query < stop) & (key >= start) & (key < stop)
    if window is not None:
        mask &= key > query - window
    group = HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask, -torch.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("window", [None, 6])
def test_spans_attend_both_ways(window):
    generator = torch.Generator().manual_seed(0)
    seq_lens = [prefix + q_len for prefix, q_len in CHUNKS]
    paged = make_paged_kv(seq_lens, KV_HEADS, HEAD_DIM, torch.float32, "cpu", generator, BLOCK_SIZE)
    starts = [0]
    for _, q_len in CHUNKS:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=generator)
    tables = paged.block_tables
    plan = plan_paged_attention(starts, seq_lens, tables, BLOCK_SIZE, window=window, bidirectional_spans=SPANS)
    out = run_paged_attention(q, paged.k_cache, paged.v_cache, plan, 0.5)
    for i, (prefix, _) in enumerate(CHUNKS):
        spans = [(start, stop) for seq, start, stop in SPANS if seq == i]
        expected = _oracle(q[starts[i] : starts[i + 1]], paged.dense_k[i], paged.dense_v[i], prefix, spans, 0.5, window)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)
    causal_plan = plan_paged_attention(starts, seq_lens, tables, BLOCK_SIZE, window=window)
    causal = run_paged_attention(q, paged.k_cache, paged.v_cache, causal_plan, 0.5)
    assert not torch.allclose(causal[: starts[3]], out[: starts[3]])  # the spans' rows moved
    torch.testing.assert_close(causal[starts[3] :], out[starts[3] :])  # the others did not


def key_limits(chunks: list[tuple[int, int]], spans: list[tuple[int, int, int]]) -> list[int]:
    """Each query token's first unseen key position: p + 1, or its span's stop (as the model runner builds them)."""
    limits = []
    for i, (prefix, q_len) in enumerate(chunks):
        for position in range(prefix, prefix + q_len):
            stops = [stop for seq, start, stop in spans if seq == i and start <= position < stop]
            limits.append(stops[0] if stops else position + 1)
    return limits


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_key_limits_equal_the_spans(device: str, dtype: torch.dtype, window) -> None:
    from conveyor_kernels.prefill_attention import prefill_attention, prefill_attention_reference
    from tests.kernels.kernel_testing import poisoned, tolerance

    generator = torch.Generator().manual_seed(1)
    seq_lens = [prefix + q_len for prefix, q_len in CHUNKS]
    paged = make_paged_kv(seq_lens, KV_HEADS, HEAD_DIM, dtype, device, generator, BLOCK_SIZE)
    starts = [0]
    for _, q_len in CHUNKS:
        starts.append(starts[-1] + q_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=generator).to(device=device, dtype=dtype)
    limits = torch.tensor(key_limits(CHUNKS, SPANS), dtype=torch.int32, device=device)
    out = poisoned(tuple(q.shape), dtype, device)
    max_query_len = max(q_len for _, q_len in CHUNKS)
    prefill_attention(
        q, paged.k_cache, paged.v_cache, query_start_loc, paged.seq_lens, paged.block_tables, 0.5, max_query_len, out,
        window=window, key_limits=limits,
    )
    expected = prefill_attention_reference(
        q, paged.k_cache, paged.v_cache, query_start_loc, paged.seq_lens, paged.block_tables, 0.5, window=window,
        bidirectional_spans=tuple(SPANS),
    )
    torch.testing.assert_close(out, expected, **tolerance(dtype))
