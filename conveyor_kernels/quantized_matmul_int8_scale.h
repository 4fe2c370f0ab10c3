// One sub-block's exact int32 sums for one token and a tile's 16 rows, added to their float32 accumulators:
// float(S) * (d * scale), S the signed sum (the format's zero point already taken off), and for the formats with a
// min + m * (scale * sum(q)). The VNNI body (quantized_matmul_int8.h) and the AMX tiles' epilogue
// (quantized_matmul_amx.cpp) both add their sums with it, so that a token's outputs are the same bit for bit
// whichever runs its step. Each includes it inside its own AVX-512 target region and namespace (hence no
// #pragma once).
template <bool kMin>
static inline __m512 int8_add_scaled_sums(__m512 acc, __m512i sums, __m512 ds, float scale, const float* m,
                                          float scaled_sum) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(ds, _mm512_set1_ps(scale)), acc);
  if constexpr (kMin) acc = _mm512_fmadd_ps(_mm512_loadu_ps(m), _mm512_set1_ps(scaled_sum), acc);
  return acc;
}
