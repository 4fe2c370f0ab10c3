"""Shared helpers for the kernel tests: tolerances, poisoned outputs, and paged KV caches built from
known dense K/V."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (num_heads, num_kv_heads): GQA group sizes 1, 4 and 8.
GQA_SHAPES = [(2, 2), (8, 2), (8, 1)]

# The Triton interpreter rounds float32 -> bf16 toward zero where GPUs round to nearest even, so a
# bf16 result may sit an ulp or two (eps = 2^-7) away from the torch reference.
_TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return _TOLERANCES[dtype]


def exact_or_one_ulp(dtype: torch.dtype, device: str) -> dict[str, float]:
    """For results that are one rounding of the same float32 value: bit-exact on a GPU and in
    float32; within one bf16 ulp under the interpreter (which truncates instead of rounding)."""
    if device == "cuda" or dtype == torch.float32:
        return {"atol": 0.0, "rtol": 0.0}
    return {"atol": 0.0, "rtol": 2**-7}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel fails to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    dense_k: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim], what was paged in
    dense_v: list[torch.Tensor]


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    generator: torch.Generator,
    block_size: int = 16,
) -> PagedKV:
    """Random dense K/V per sequence, scattered token by token into blocks drawn at random from a
    pool that is larger than needed. Every other cache slot holds unrelated random values, and the
    padding entries of the block tables point at block 0, which belongs to some sequence, so a
    kernel reading past a context's end or through the wrong block gets a wrong answer."""
    blocks_needed = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    max_blocks = max(blocks_needed, default=0) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    dense_k, dense_v = [], []
    for seq, length in enumerate(seq_lens):
        table = [pool.pop() for _ in range(blocks_needed[seq])]
        block_tables[seq, : len(table)] = torch.tensor(table, dtype=torch.int32)
        keys = torch.randn(length, num_kv_heads, head_dim, generator=generator).to(dtype)
        values = torch.randn(length, num_kv_heads, head_dim, generator=generator).to(dtype)
        for position in range(length):
            block, offset = table[position // block_size], position % block_size
            k_cache[block, offset] = keys[position]
            v_cache[block, offset] = values[position]
        dense_k.append(keys.to(device))
        dense_v.append(values.to(device))
    return PagedKV(
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        dense_k=dense_k,
        dense_v=dense_v,
    )


def naive_attention(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_dim], dense
    values: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the last q_len positions of a sequence, in float64, head by head and
    row by row: the slow, obvious oracle for the references. With a `window` a query at position p
    sees keys in (p - window, p]; `softcap` caps the scores at softcap * tanh(scores / softcap)."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for head in range(num_heads):
        k = keys[:, head // group].double().cpu()
        v = values[:, head // group].double().cpu()
        for row in range(q_len):
            visible = seq_len - q_len + row + 1
            first = 0 if window is None else max(0, visible - window)
            scores = (k[first:visible] @ q[row, head].double().cpu()) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            weights = torch.exp(scores - scores.max())
            out[row, head] = (weights / weights.sum()) @ v[first:visible]
    return out
