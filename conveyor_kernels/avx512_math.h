// AVX-512 float32 helpers shared by the CPU kernels (cpu_kernels.h), the int8 cache's decode attention
// (vector_decode_avx512.cpp) and the quantized matmul's bf16 path (quantized_matmul_avx512_bf16.cpp): included
// where AVX-512 is enabled, -march=native in the first, a target pragma in the others.
#pragma once
#include <immintrin.h>

// 2^x = 2^n * 2^f with n = round(x), |f| <= 1/2 and 2^f by its degree-5 Taylor polynomial: relative error below
// 3e-6, far under the bf16 rounding of the probabilities. Very negative x gives exactly 0 (scalef).
static inline __m512 exp2_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Lane i of the result: the sum of v[i]'s 16 lanes. A transpose-and-add tree, 45 instructions where 16 separate
// horizontal sums take about 130.
static inline __m512 sum_lanes_16(const __m512* v) {
  __m512 w[8], y[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane's sum of v[4k], .., v[4k + 3]
    const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
    y[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Then across the 128-bit lanes: 0x88 takes lanes (0, 2) of each operand, 0xdd lanes (1, 3).
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}
