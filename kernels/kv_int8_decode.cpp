// Paged decode attention over an int8 KV cache (kernels/kv_quant.py: each (token, kv head) row is head_dim int8
// values, then their float32 scale). The body (kv_int8_decode_body.h) is compiled twice: for AVX-512 (16 float
// lanes) and for AVX2 + FMA (8); the instruction set is chosen at run time from what the CPU reports, or forced by
// the caller, which is how the tests run both on one machine and the benchmark compares them. Built without
// -march=native so that the one build runs on any x86-64 (as quantized_matmul.cpp). Other CPUs, head_dims and
// fp16 queries take cpu_kernels.cpp's portable kernel (cpu_kernels.py dispatches).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "isa_dispatch.h"

namespace {

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

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")
#include "avx512_math.h"  // exp2_ps, sum_lanes_16 (cpu_kernels.cpp's too)
namespace isa_avx512 {
using vec = __m512;
constexpr int64_t W = 16;
static inline vec load(const float* p) { return _mm512_loadu_ps(p); }
static inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec set1(float x) { return _mm512_set1_ps(x); }
static inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline float reduce_add(vec v) { return _mm512_reduce_add_ps(v); }
static inline float reduce_max(vec v) { return _mm512_reduce_max_ps(v); }
static inline vec load_int8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline vec exp2(vec x) { return exp2_ps(x); }
static inline vec sum_lanes(const vec* v) { return sum_lanes_16(v); }
#include "kv_int8_decode_body.h"
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace isa_avx2 {
using vec = __m256;
constexpr int64_t W = 8;
static inline vec load(const float* p) { return _mm256_loadu_ps(p); }
static inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec set1(float x) { return _mm256_set1_ps(x); }
static inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline float reduce_max(vec v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
static inline float reduce_add(vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
static inline vec load_int8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// As the AVX-512 exp2, with 2^n built in the exponent bits; x is kept above -126 so that 2^n stays a normal float
// (below that the result, under 2^-126, is as good as the AVX-512 path's 0 for a softmax weight).
static inline vec exp2(vec x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.3333558146428443e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022650695910071f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.69314718055994531f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
// Lane i of the result: the sum of v[i]'s 8 lanes. hadd pairs within 128-bit lanes twice, then the two halves add.
static inline vec sum_lanes(const vec* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // [v0..v3 low | v0..v3 high], v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#include "kv_int8_decode_body.h"
}  // namespace isa_avx2
#pragma GCC pop_options
#define CONVEYOR_X86_PATHS 1
#endif

namespace {

using isa_dispatch::Isa;
using isa_dispatch::best_isa;
using isa_dispatch::isa_name;
using isa_dispatch::parse_isa;

}  // namespace

bool supports(int64_t head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256; }

std::string best_isa_name() { return isa_name(best_isa()); }

// The rows token_index[i] of `out` get sequence i's attention over its seq_lens[i] positions; other rows are left
// alone. query / out: float32 or bf16; caches int8 [num_blocks, block_size, num_kv_heads, head_dim + 4].
void decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                      torch::Tensor seq_lens, torch::Tensor token_index, torch::Tensor out, double scale, int64_t window,
                      double softcap, const std::string& isa_choice) {
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(supports(head_dim), "no int8 decode kernel for head_dim ", head_dim);
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar, "int8 caches");
  TORCH_CHECK(k_cache.size(3) == head_dim + 4 && v_cache.sizes() == k_cache.sizes(), "an int8 row is head_dim + 4 bytes");
  TORCH_CHECK(query.scalar_type() == out.scalar_type() &&
                  (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16), "float32 or bf16 queries");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.stride(1) == head_dim, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(token_index.scalar_type() == torch::kInt64, "int64 token_index");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads a multiple of kv heads");
  const Isa isa = parse_isa(isa_choice);
  // Its portable path is the C++ CPU kernels' own (cpu_kernels.cpp), not this build's.
  TORCH_CHECK(isa != Isa::Portable, "no portable int8 decode path here; this CPU has neither AVX-512 nor AVX2");
#ifdef CONVEYOR_X86_PATHS
  const auto run = [&](auto dim, auto* q) {
    using q_t = std::remove_const_t<std::remove_pointer_t<decltype(q)>>;
    constexpr int64_t kDim = decltype(dim)::value;
    auto* kernel = isa == Isa::Avx512 ? &isa_avx512::decode<kDim, q_t> : &isa_avx2::decode<kDim, q_t>;
    kernel(q, query.stride(0), query.stride(1), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
           block_tables.data_ptr<int32_t>(), block_tables.size(1), seq_lens.data_ptr<int32_t>(),
           token_index.data_ptr<int64_t>(), reinterpret_cast<q_t*>(out.data_ptr()), out.stride(0), seq_lens.size(0),
           query.size(1), k_cache.size(2), k_cache.size(1), static_cast<float>(scale), window,
           static_cast<float>(softcap));
  };
  const auto for_dtype = [&](auto dim) {
    if (query.scalar_type() == at::kFloat) run(dim, query.data_ptr<float>());
    else run(dim, reinterpret_cast<const uint16_t*>(query.data_ptr()));
  };
  switch (head_dim) {
    case 32: for_dtype(std::integral_constant<int64_t, 32>{}); return;
    case 64: for_dtype(std::integral_constant<int64_t, 64>{}); return;
    case 128: for_dtype(std::integral_constant<int64_t, 128>{}); return;
    default: for_dtype(std::integral_constant<int64_t, 256>{}); return;
  }
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over an int8 KV cache (AVX-512 / AVX2)");
  m.def("supports", &supports, "whether decode_attention has a kernel for this head_dim");
  m.def("best_isa", &best_isa_name, "the widest path this CPU runs: avx512, avx2 or portable (the C++ CPU kernels' own)");
}
