// The bf16 path of the quantized matmul: bf16 x on CPUs with AVX-512 BF16. quantized_matmul_avx512_bf16.cpp
// includes it once, inside `namespace quantized_matmul::isa_avx512_bf16` under `#pragma GCC target(... avx512bf16
// ...)`; it dequantizes with the AVX-512 body's row kernel (isa_avx512::row_kernels: one copy of the formats' code).
//
// Why: with 16 tokens a step (16 sequences decoding) the float32 path is bound by its FMAs, 16 products an
// instruction, and loses to oneDNN's bf16 matmul of the unquantized weight (vdpbf16ps: 32 products an
// instruction). Here each row of a tile is dequantized to float32 exactly as the float32 path does it (gguf-py's
// values), rounded to bf16 into a bf16 tile, and the tile multiplied with vdpbf16ps. The weights multiplied are
// thus exactly `dequantize(w).to(torch.bfloat16)`, the ones quantized_matmul.linear's dequantize-then-matmul
// (above 32 tokens) multiplies in a bf16 run: a bf16 run has one numeric behaviour whatever its steps' sizes.
//
// Rounding: vcvtne2ps2bf16 rounds to nearest even, as torch's float -> bf16 conversion does (NaN stays NaN). It and
// vdpbf16ps treat denormal inputs (|v| < 2^-126) as zero, where torch keeps a bf16 denormal: no GGUF value is one
// (float16 scales times small integers: 0 or at least 2^-24 in magnitude); an int8 / int4 / UINT4_ZP group whose
// float32 scale makes one contributes 0 instead of under 2^-126 |x|. The sums are float32 in another order than
// torch's: each lane adds its pairs' products (exact: 8 x 8 significant bits), then the 16 lanes are summed.

// One row of n float32 values rounded to bf16 (the bits of torch.bfloat16), 32 at a time, the last < 32 masked.
static void round_row_to_bf16(const float* y, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)  // cvtne2ps_pbh(a, b): b's 16 values first, then a's
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(y + i + 16), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const int left = (int)(n - i);
    const __mmask16 low = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __mmask16 high = left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : (__mmask16)0;
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, y + i + 16), _mm512_maskz_loadu_ps(low, y + i));
    _mm512_mask_storeu_epi16(out + i, (__mmask32)((1u << left) - 1), (__m512i)v);
  }
}

// 32 bf16 values (16 pairs for vdpbf16ps); masked: those outside `mask` read as +0, whose products add nothing. A
// plain load wherever the 32 are all in the row: GCC cannot tell what a masked load reads, so with masked loads in
// the main loop it kept the accumulators in memory (16 stores a step), slower than the float32 path.
template <bool kMasked>
static inline __m512bh load_pairs(const uint16_t* p, __mmask32 mask) {
  if constexpr (kMasked) return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
  return (__m512bh)_mm512_loadu_si512(p);
}

// out[m, r] for MT tokens of x (rows ldx apart) and RT rows of the bf16 tile (k values each): MT x RT accumulators of
// 16 float32 lanes in registers (4 x 4: 16 of the 32, beside 4 weight vectors and one of x).
template <int MT, int RT>
static inline void micro_tile(const uint16_t* x, int64_t ldx, const uint16_t* tile, int64_t k, float* out, int64_t ldo) {
  __m512 acc[MT * RT];
  for (int j = 0; j < MT * RT; ++j) acc[j] = _mm512_setzero_ps();
  const auto step = [&](int64_t i, __mmask32 mask, auto masked) __attribute__((always_inline)) {
    constexpr bool kMasked = decltype(masked)::value;
    __m512bh w[RT];
    for (int r = 0; r < RT; ++r) w[r] = load_pairs<kMasked>(tile + r * k + i, mask);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = load_pairs<kMasked>(x + m * ldx + i, mask);
      for (int r = 0; r < RT; ++r) acc[m * RT + r] = _mm512_dpbf16_ps(acc[m * RT + r], xv, w[r]);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) step(i, 0, std::false_type{});
  if (i < k) step(i, (__mmask32)((1u << (k - i)) - 1), std::true_type{});  // rows not whole 32s (small groups)
  if constexpr (MT * RT == 16) {  // one transpose-and-add tree for all 16 sums
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum_lanes_16(acc));
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < RT; ++r) out[m * ldo + r] = sums[m * RT + r];
  } else {
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < RT; ++r) out[m * ldo + r] = _mm512_reduce_add_ps(acc[m * RT + r]);
  }
}

// RT rows of the tile times every token: 4 tokens at a time, then the last 1-3 together (each pass reads the rows).
template <int RT>
static void tile_times_tokens(const uint16_t* x, int64_t tokens, const uint16_t* tile, int64_t k, float* out,
                              int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= tokens; m += 4) micro_tile<4, RT>(x + m * k, k, tile, k, out + m * ldo, ldo);
  switch (tokens - m) {
    case 3: micro_tile<3, RT>(x + m * k, k, tile, k, out + m * ldo, ldo); break;
    case 2: micro_tile<2, RT>(x + m * k, k, tile, k, out + m * ldo, ldo); break;
    case 1: micro_tile<1, RT>(x + m * k, k, tile, k, out + m * ldo, ldo); break;
  }
}

// out[:, begin:end] = x @ bf16(dequantize(weight[begin:end])).T, x bf16 [tokens, columns]: a tile of kTileRows rows
// dequantized a row at a time into `row` (columns floats, in L1) and rounded into `tile` (kTileRows * columns
// bf16), then multiplied by every token while it sits in L1/L2.
void matmul_rows_bf16(const Format& format, const uint16_t* x, int64_t tokens, const uint8_t* weight,
                      int64_t row_bytes, int64_t columns, int64_t begin, int64_t end, float* out, int64_t out_columns,
                      float* row, uint16_t* tile) {
  for (int64_t n0 = begin; n0 < end; n0 += kTileRows) {
    const int64_t rows = end - n0 < kTileRows ? end - n0 : kTileRows;
    for (int64_t r = 0; r < rows; ++r) {
      // one row (rows [0, 1) of a weight starting at it): a call per row, not per value
      isa_avx512::row_kernels.dequantize_rows(format, weight + (n0 + r) * row_bytes, row_bytes, columns, 0, 1, row);
      round_row_to_bf16(row, tile + r * columns, columns);
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) tile_times_tokens<4>(x, tokens, tile + r * columns, columns, out + n0 + r, out_columns);
    for (; r < rows; ++r) tile_times_tokens<1>(x, tokens, tile + r * columns, columns, out + n0 + r, out_columns);
  }
}
