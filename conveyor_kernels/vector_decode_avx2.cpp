// The vector decode attention body (vector_decode_body.h) for AVX2 + FMA: 8 float lanes, and the vector
// helpers the body calls for them. vector_decode.h, which includes everything the body uses, comes first, outside
// the target pragma (see there).
#include "vector_decode.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace vector_decode::isa_avx2 {
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
#include "vector_decode_body.h"
}  // namespace vector_decode::isa_avx2
#pragma GCC pop_options
#endif
