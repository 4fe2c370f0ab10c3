// What the vector decode attention files share (the AVX-512 / AVX2 kernels of int8 and float32 caches): the bf16 /
// float conversions and the no-score constant of vector_decode_body.h, and the kernels each instruction-set build
// exports. vector_decode.cpp (the Python module: checks, the run-time choice of path) calls them through
// `DecodeKernels`; vector_decode_avx512.cpp and vector_decode_avx2.cpp each compile the body for their instruction
// set, so that ninja builds them in parallel.
// Only ATen's parallel_for from torch: the full extension header would cost each file seconds of parsing.
// Everything the body uses is included here, before any file's target pragma: an inline function compiled under
// it would be the linker's one copy for every file, and stop a CPU without that instruction set.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "paged_rows.h"  // first_position, locate

namespace vector_decode {

// Below any real score, and finite. exp2(kNoScore - score) is exactly 0.
constexpr float kNoScore = -1e30f;

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

template <typename T>
T from_float(float x);

template <>
inline float from_float<float>(float x) { return x; }

template <>
inline uint16_t from_float<uint16_t>(float x) {  // to bf16, round to nearest even, as c10::BFloat16 rounds
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// The body's `decode<head_dim, q_t, cache_t>`; q_t: float, or uint16_t holding bf16 bits; cache_t: int8_t (rows of
// head_dim values and their float32 scale, conveyor_kernels/kv_quant.py) or float.
template <typename q_t, typename cache_t>
using DecodeKernel = void (*)(const q_t* query, int64_t query_row_stride, int64_t query_head_stride,
                              const cache_t* k_cache, const cache_t* v_cache, const int32_t* block_tables,
                              int64_t max_blocks, const int32_t* seq_lens, const int64_t* token_index, q_t* out,
                              int64_t out_row_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t block_size, float scale, int64_t window, float softcap);

// One instruction set's kernels, by head_dim (kHeadDims), cache and query type.
constexpr int64_t kHeadDims[] = {32, 64, 128, 256};
struct DecodeKernels {
  DecodeKernel<float, int8_t> int8_cache_float32[4];
  DecodeKernel<uint16_t, int8_t> int8_cache_bf16[4];
  DecodeKernel<float, float> float32_cache[4];  // float32 queries
};

#if defined(__x86_64__) && defined(__GNUC__)
namespace isa_avx512 { extern const DecodeKernels decode_kernels; }  // vector_decode_avx512.cpp
namespace isa_avx2 { extern const DecodeKernels decode_kernels; }  // vector_decode_avx2.cpp
#endif

}  // namespace vector_decode
