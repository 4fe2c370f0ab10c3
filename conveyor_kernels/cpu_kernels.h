// What the C++ CPU kernels' files share (cpu_kernels.py builds them as one extension, a file per concept, which
// ninja compiles in parallel): the instruction sets this build has, the constants and the bf16 vector helpers of
// more than one kernel, and every kernel's entry point, which cpu_kernels.cpp binds to Python.
// Built with -march=native: the instruction sets are the build machine's, and the build is per CPU (see
// cpu_kernels.py). Without AVX-512 BF16 the decode attention keeps its portable kernel.
// Only the ATen headers every file needs: each file parses what it includes, seconds for the larger ones, so
// pybind11 is for cpu_kernels.cpp alone, and dtype dispatch and the factory functions are for the files that use
// them.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "paged_rows.h"  // the decode attention's first_position, locate

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#include <immintrin.h>
#define CONVEYOR_AVX512_BF16 1
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>  // the int8 KV rows' dequantization (cpu_decode_attention.cpp's widen_row)
#endif
#if defined(CONVEYOR_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CONVEYOR_AMX 1
#endif

// Widen n values to float. The bfloat16 case is spelled as the bit shift it is, which the compiler
// vectorizes; c10::BFloat16's conversion operator it does not.
template <typename scalar_t>
static inline void widen(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// Below any real score, and finite: the kernels are built with -ffast-math (vectorized exp),
// under which infinities are not allowed. exp(kNoScore - score) is exactly 0.
constexpr float kNoScore = -1e30f;

// The elementwise kernels keep work under this many elements on one thread: a parallel region costs microseconds,
// and on a loaded machine one of its threads waiting for a core stalls the whole region (a decode step runs
// hundreds of them).
constexpr int64_t kSerialElements = 65536;

#ifdef CONVEYOR_AVX512_BF16
#include "avx512_math.h"  // exp2_ps, sum_lanes_16

static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (1u << n) - 1; }

static inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// float32 -> bf16 rounding kept in float32 lanes (the low 16 bits cleared): round to nearest even, as
// c10::BFloat16 rounds.
static inline __m512 round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 16 floats already rounded by round_bf16, stored as bf16.
static inline void store_bf16(uint16_t* p, __m512 rounded) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
#endif

// The kernels' entry points, by file.

// cpu_decode_attention.cpp
void paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                            at::Tensor seq_lens, at::Tensor token_index, at::Tensor out, double scale, int64_t window,
                            double softcap);

// cpu_prefill_attention.cpp
bool prefill_attention_available(int64_t head_dim);
void paged_prefill_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_starts, at::Tensor query_ends, at::Tensor out,
                             double scale, int64_t window);

// cpu_layer_ops.cpp
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
void rotary_in_place(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor gate_up);
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping);

// cpu_sampling.cpp
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask);
std::tuple<at::Tensor, at::Tensor> greedy_sample(at::Tensor logits);

// cpu_encoder.cpp
bool encoder_kernels_available();
at::Tensor encoder_attention(at::Tensor qkv, at::Tensor seq_starts, int64_t num_heads, double scale);
at::Tensor layer_norm(at::Tensor x, at::Tensor weight, at::Tensor bias, double eps);
