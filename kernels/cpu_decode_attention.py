"""Paged decode attention for the CPU, as a small C++ kernel built on first use.

Decode on a CPU is bound by memory bandwidth. The torch path (`paged_attention.py`) has to gather
each sequence's blocks into a padded copy before SDPA can read them: three passes over the K/V
bytes. This kernel reads K/V once, straight through the block tables, with an online softmax per
block, for all query heads of a kv head at a time (GQA reads K/V once per group). Its oracle is
`paged_attention_reference`.

The extension compiles with torch's cpp_extension (ninja + the system C++ compiler) into
`$TORCH_EXTENSIONS_DIR`, once per machine. Where it cannot be built, `load_decode_kernel()` returns
None and the engine keeps the torch path.
"""

from __future__ import annotations

import logging
from functools import cache
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

template <typename scalar_t>
static void decode_kernel(
    const scalar_t* query, int64_t query_row_stride, int64_t query_head_stride,
    const scalar_t* k_cache, const scalar_t* v_cache,
    const int32_t* block_tables, int64_t max_blocks,
    const int32_t* seq_lens, const int64_t* token_index,
    scalar_t* out, int64_t out_row_stride,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;  // between consecutive tokens in the cache
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores(group * block_size);
    std::vector<float> keys(block_size * head_dim), values(block_size * head_dim);
    std::vector<float> running_max(group), running_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t length = seq_lens[seq];
      const int64_t row = token_index[seq];
      for (int64_t j = 0; j < group; ++j) {
        const scalar_t* src = query + row * query_row_stride + (kv_head * group + j) * query_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) q[j * head_dim + d] = static_cast<float>(src[d]) * scale;
        running_max[j] = -std::numeric_limits<float>::infinity();
        running_sum[j] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t num_blocks = (length + block_size - 1) / block_size;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t block = block_tables[seq * max_blocks + b];
        const int64_t tokens = std::min(block_size, length - b * block_size);
        const scalar_t* k_block = k_cache + block * block_size * slot_stride + kv_head * head_dim;
        const scalar_t* v_block = v_cache + block * block_size * slot_stride + kv_head * head_dim;
        // Widen the block's K and V once; every query head of the group then reads floats.
        for (int64_t t = 0; t < tokens; ++t) {
          const scalar_t* k = k_block + t * slot_stride;
          const scalar_t* v = v_block + t * slot_stride;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) {
            keys[t * head_dim + d] = static_cast<float>(k[d]);
            values[t * head_dim + d] = static_cast<float>(v[d]);
          }
        }
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = &q[j * head_dim];
          float* sj = &scores[j * block_size];
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < tokens; ++t) {
            const float* k = &keys[t * head_dim];
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qj[d] * k[d];
            sj[t] = s;
            block_max = std::max(block_max, s);
          }
          const float new_max = std::max(running_max[j], block_max);
          const float correction = std::exp(running_max[j] - new_max);
          float* aj = &acc[j * head_dim];
          float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t t = 0; t < tokens; ++t) {
            sj[t] = std::exp(sj[t] - new_max);
            block_sum += sj[t];
          }
          running_sum[j] = running_sum[j] * correction + block_sum;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) aj[d] *= correction;
          for (int64_t t = 0; t < tokens; ++t) {
            const float p = sj[t];
            const float* v = &values[t * head_dim];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) aj[d] += p * v[d];
          }
          running_max[j] = new_max;
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        scalar_t* dst = out + row * out_row_stride + (kv_head * group + j) * head_dim;
        const float inv = running_sum[j] > 0.f ? 1.f / running_sum[j] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[j * head_dim + d] * inv);
      }
    }
  });
}

void paged_decode_attention(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, torch::Tensor token_index, torch::Tensor out, double scale) {
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.stride(1) == out.size(2), "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(token_index.scalar_type() == torch::kInt64, "int64 token_index");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(
        query.data_ptr<scalar_t>(), query.stride(0), query.stride(1),
        k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        block_tables.data_ptr<int32_t>(), block_tables.size(1),
        seq_lens.data_ptr<int32_t>(), token_index.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), out.stride(0),
        seq_lens.size(0), query.size(1), k_cache.size(2), k_cache.size(3), k_cache.size(1),
        static_cast<float>(scale));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
"""


@cache
def load_decode_kernel() -> ModuleType | None:
    """The compiled extension, or None where it cannot be built (no compiler, no ninja)."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load_inline(
            name="conveyor_cpu_decode_attention_v4",
            cpp_sources=[_SOURCE],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # any build failure means: use the torch path
        log.warning("CPU decode attention kernel unavailable, using the torch path: %s", error)
        return None


def paged_decode_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]; head_dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length of each decode row
    token_index: torch.Tensor,  # [B] int64: the query row of each decode sequence
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]: rows in token_index are written
) -> None:
    kernel = load_decode_kernel()
    if kernel is None:
        raise RuntimeError("the CPU decode attention kernel could not be built")
    kernel.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, token_index, out, scale)
