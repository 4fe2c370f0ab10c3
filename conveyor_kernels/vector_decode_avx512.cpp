// The vector decode attention body (vector_decode_body.h) for AVX-512: 16 float lanes, and the vector
// helpers the body calls for them. vector_decode.h, which includes everything the body uses, comes first, outside
// the target pragma (see there).
#include "vector_decode.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")
#include "avx512_math.h"  // exp2_ps, sum_lanes_16 (the CPU kernels' too)
namespace vector_decode::isa_avx512 {
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
#include "vector_decode_body.h"
}  // namespace vector_decode::isa_avx512
#pragma GCC pop_options
#endif
