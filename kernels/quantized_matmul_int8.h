// The int8-activation body of the quantized matmul (llama.cpp's way of multiplying quantized weights): the step's
// tokens are quantized to int8 and multiplied by the weights' own integer quants with integer dot products, instead
// of dequantizing the weights to floats. Included inside `namespace quantized_matmul::isa_<name>` under that set's
// `#pragma GCC target(...)`: by quantized_matmul_avx512.cpp, _avx2.cpp and _portable.cpp (after the float body), with
// the plain C++ dot product below, and by quantized_matmul_avx512_vnni.cpp with INT8_VNNI defined, whose dot product
// is AVX-512 VNNI's vpdpbusd (64 byte products an instruction, against vdpbf16ps' 32 bf16 ones). Each exports its
// set's `int8_kernels` (quantized_matmul.h).
//
// Activations: per token, per block of 32 values, scale = max |x| / 127 and q = round(x / scale), halves to even,
// in float32: exactly kernels/quantized_matmul.py's quantize_activations_reference; and the sum of each 16 q.
//
// Weights, repacked once at load (pack_tile): every format's values are d * (u - offset) + m per sub-block of 32
// values (Q6_K: 16), u an unsigned quant of at most 8 bits, offset the format's constant zero point
// (int8_offset: Q4_0 / int4 8, Q5_0 16, Q6_K 32, Q8_0 / int8 128 with u = q + 128) and d, m float32: Q4_1 / Q5_1 the
// block's min; Q4_K / Q5_K the sub-block's d = super-block d * 6-bit scale, m = -(dmin * 6-bit min); Q6_K d =
// super-block d * int8 scale; AWQ / GPTQ m = -(zero point * scale). These are the dequantized values exactly (each
// product is exact in float32: quantized_matmul_body.h computes the same ones). A tile of 16 rows keeps its quants
// in the order the dot product reads them: 8-bit, byte 64 j + 4 r + c is row r's value 4 j + c (dword j of the 16
// rows in one vector); 4-bit, byte 64 i + 4 r + c holds row r's values 8 i + c (low nibble) and 8 i + 4 + c (high).
// Then per token and sub-block: S = sum(u * q) - offset * sum(q), exact in int32 (one lane per row), and
// out += float(S) * (d * scale_x) + m * (scale_x * sum(q)). The only roundings are those float32 products and sums:
// the result is the float64 product of the quantized x and the dequantized weights to float32's precision, in
// another order (quantized_matmul.py's matmul_int8_reference).

// Round-half-even of |v| < 2^22 in the default rounding mode (as torch.round), in plain arithmetic so GCC vectorizes it.
static inline float int8_round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

static void quantize_activations(const float* x32, const uint16_t* x16, int64_t tokens, int64_t columns,
                                 int8_t* quants, float* scales, int32_t* sums) {
  const int64_t blocks = columns / kActivationBlock;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = t * columns + b * kActivationBlock;
      float v[kActivationBlock];
      if (x16 != nullptr) {
        for (int i = 0; i < kActivationBlock; ++i) {
          const uint32_t bits = (uint32_t)x16[at + i] << 16;
          __builtin_memcpy(&v[i], &bits, 4);
        }
      } else {
        __builtin_memcpy(v, x32 + at, sizeof(v));
      }
      float amax = 0.0f;
      for (int i = 0; i < kActivationBlock; ++i) amax = __builtin_fmaxf(amax, __builtin_fabsf(v[i]));
      const float scale = amax / 127.0f;
      int q[kActivationBlock];
      for (int i = 0; i < kActivationBlock; ++i) {
        float r = scale > 0.0f ? int8_round_even(v[i] / scale) : 0.0f;
        q[i] = (int)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
        quants[at + i] = (int8_t)q[i];
      }
      for (int half = 0; half < 2; ++half) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += q[16 * half + i];
        sums[t * (columns / 16) + 2 * b + half] = sum;
      }
      scales[t * blocks + b] = scale;
    }
  }
}

// One weight row's unsigned quants u (`columns` of them), with each sub-block's d and m written `stride` floats
// apart (a tile keeps its 16 rows' values of a sub-block together).
static void int8_unpack_row(const Format& format, const uint8_t* row, int64_t columns, uint8_t* u, float* d, float* m,
                            int64_t stride) {
  const int64_t blocks = columns / format.block_values;
  for (int64_t i = 0; i < blocks; ++i, row += format.block_bytes, u += format.block_values) {
    const uint8_t* b = row;
    switch (format.kind) {
      case Kind::Q4_0:
      case Kind::Q4_1: {
        const bool has_min = format.kind == Kind::Q4_1;
        const uint8_t* qs = b + (has_min ? 4 : 2);
        for (int j = 0; j < 16; ++j) {
          u[j] = qs[j] & 0x0F;
          u[j + 16] = qs[j] >> 4;
        }
        d[i * stride] = half_to_float(b);
        m[i * stride] = has_min ? half_to_float(b + 2) : 0.0f;
        break;
      }
      case Kind::Q5_0:
      case Kind::Q5_1: {
        const bool has_min = format.kind == Kind::Q5_1;
        uint32_t qh;
        __builtin_memcpy(&qh, b + (has_min ? 4 : 2), 4);
        const uint8_t* qs = b + (has_min ? 8 : 6);
        for (int j = 0; j < 16; ++j) {
          u[j] = (uint8_t)((qs[j] & 0x0F) | (((qh >> j) & 1) << 4));
          u[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        d[i * stride] = half_to_float(b);
        m[i * stride] = has_min ? half_to_float(b + 2) : 0.0f;
        break;
      }
      case Kind::Q8_0:
        for (int j = 0; j < 32; ++j) u[j] = (uint8_t)((int8_t)b[2 + j] + 128);
        d[i * stride] = half_to_float(b);
        m[i * stride] = 0.0f;
        break;
      case Kind::Q4_K:
      case Kind::Q5_K: {  // 8 sub-blocks of 32: chunk c's low nibbles are sub-block 2c, its high nibbles 2c + 1
        const bool five = format.kind == Kind::Q5_K;
        const float dd = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t* qh = b + 16;
        const uint8_t* ql = b + (five ? 48 : 16);
        for (int c = 0; c < 4; ++c, ql += 32) {
          for (int l = 0; l < 32; ++l) {
            const int high1 = five ? ((qh[l] >> (2 * c)) & 1) << 4 : 0;
            const int high2 = five ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
            u[64 * c + l] = (uint8_t)((ql[l] & 0x0F) | high1);
            u[64 * c + 32 + l] = (uint8_t)((ql[l] >> 4) | high2);
          }
          for (int s = 0; s < 2; ++s) {
            int sc, mn;
            scale_min_k4(2 * c + s, b + 4, &sc, &mn);
            const int64_t sub = i * 8 + 2 * c + s;
            d[sub * stride] = dd * (float)sc;
            m[sub * stride] = -(dmin * (float)mn);
          }
        }
        break;
      }
      case Kind::Q6_K: {  // 16 sub-blocks of 16, each with an int8 scale
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        const float dd = half_to_float(b + 208);
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32) {
          uint8_t* y = u + 128 * half;
          for (int l = 0; l < 32; ++l) {
            y[l] = (uint8_t)((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4));
            y[l + 32] = (uint8_t)((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
            y[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            y[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
          }
        }
        for (int s = 0; s < 16; ++s) {
          d[(i * 16 + s) * stride] = dd * (float)sc[s];
          m[(i * 16 + s) * stride] = 0.0f;
        }
        break;
      }
      case Kind::INT8:
      case Kind::INT4:
      case Kind::UINT4_ZP: {  // a float32 scale (AWQ / GPTQ: then the zero point), the group's values
        const int group = format.block_values;
        float scale;
        __builtin_memcpy(&scale, b, 4);
        float min = 0.0f;
        if (format.kind == Kind::INT8) {
          for (int j = 0; j < group; ++j) u[j] = (uint8_t)((int8_t)b[4 + j] + 128);
        } else {
          const uint8_t* qs = b + (format.kind == Kind::INT4 ? 4 : 5);
          for (int j = 0; j < group / 2; ++j) {
            u[j] = qs[j] & 0x0F;
            u[j + group / 2] = qs[j] >> 4;
          }
          if (format.kind == Kind::UINT4_ZP) min = -((float)b[4] * scale);
        }
        for (int s = 0; s < group / 32; ++s) {
          d[(i * (group / 32) + s) * stride] = scale;
          m[(i * (group / 32) + s) * stride] = min;
        }
        break;
      }
    }
  }
}

// Weight rows [0, rows) (rows <= 16; the tile's other rows are zeros) as one tile: its quants in the dot product's
// order, and per sub-block the 16 rows' d and (formats with a min) m. At load time: plain loops.
static void pack_tile(const Format& format, const uint8_t* weight, int64_t row_bytes, int64_t columns, int64_t rows,
                      uint8_t* quants, float* scales, float* mins) {
  const int64_t subs = columns / int8_sub_block(format.kind);
  uint8_t* staging = new uint8_t[kTileRows * columns]();
  float* unused_mins = int8_has_min(format.kind) ? nullptr : new float[subs * kTileRows];
  float* m = unused_mins ? unused_mins : mins;
  for (int64_t s = 0; s < subs * kTileRows; ++s) scales[s] = m[s] = 0.0f;
  for (int64_t r = 0; r < rows; ++r)
    int8_unpack_row(format, weight + r * row_bytes, columns, staging + r * columns, scales + r, m + r, kTileRows);
  for (int64_t r = 0; r < kTileRows; ++r) {
    const uint8_t* u = staging + r * columns;
    if (int8_bits(format.kind) == 8) {
      for (int64_t k = 0; k < columns; ++k) quants[(k / 4) * 64 + r * 4 + k % 4] = u[k];
    } else {
      for (int64_t k = 0; k < columns; k += 8)
        for (int c = 0; c < 4; ++c) quants[(k / 8) * 64 + r * 4 + c] = (uint8_t)(u[k + c] | (u[k + 4 + c] << 4));
    }
  }
  delete[] staging;
  delete[] unused_mins;
}

#ifdef INT8_VNNI
// out[t0 .. t0 + MT, 0 .. rows) for MT tokens and one tile's 16 rows (an int32 / float32 lane each).
template <int MT, int kBits, int kSub, int kOffset, bool kMin>
static inline void int8_micro(const uint8_t* quants, const float* d, const float* m, int64_t s_begin,
                              int64_t s_end, bool accumulate, const Int8Activations& x, int64_t t0, int64_t columns,
                              float* out, int64_t ldo, int64_t rows) {
  const int64_t xblocks = columns / kActivationBlock, xsums = columns / 16;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __mmask16 mask = (__mmask16)((1u << rows) - 1);
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = accumulate ? _mm512_maskz_loadu_ps(mask, out + (t0 + t) * ldo) : _mm512_setzero_ps();
  for (int64_t s = s_begin; s < s_end; ++s) {
    __m512i dot[MT];
    for (int t = 0; t < MT; ++t) dot[t] = _mm512_setzero_si512();
    const int64_t k0 = s * kSub;
    const auto multiply = [&](const __m512i w, int64_t k) __attribute__((always_inline)) {
      for (int t = 0; t < MT; ++t) {
        int32_t xq;
        __builtin_memcpy(&xq, x.quants + (t0 + t) * columns + k, 4);
        dot[t] = _mm512_dpbusd_epi32(dot[t], w, _mm512_set1_epi32(xq));
      }
    };
    if constexpr (kBits == 8) {
      for (int j = 0; j < kSub / 4; ++j) multiply(_mm512_loadu_si512(quants + (k0 / 4 + j) * 64), k0 + 4 * j);
    } else {
      for (int i = 0; i < kSub / 8; ++i) {
        const __m512i packed = _mm512_loadu_si512(quants + (k0 / 8 + i) * 64);
        multiply(_mm512_and_si512(packed, low_nibbles), k0 + 8 * i);
        multiply(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles), k0 + 8 * i + 4);
      }
    }
    const __m512 ds = _mm512_loadu_ps(d + s * kTileRows);
    const int64_t xb = k0 / kActivationBlock;
    for (int t = 0; t < MT; ++t) {
      const int32_t* sums = x.sums + (t0 + t) * xsums + k0 / 16;
      const int32_t qsum = kSub == 32 ? sums[0] + sums[1] : sums[0];
      const __m512i exact = kOffset ? _mm512_sub_epi32(dot[t], _mm512_set1_epi32(kOffset * qsum)) : dot[t];
      const float scale = x.scales[(t0 + t) * xblocks + xb];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(ds, _mm512_set1_ps(scale)), acc[t]);
      if constexpr (kMin)
        acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(m + s * kTileRows), _mm512_set1_ps(scale * (float)qsum), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_mask_storeu_ps(out + (t0 + t) * ldo, mask, acc[t]);
}
#else
typedef int32_t int8_vi __attribute__((vector_size(kTileRows * 4), aligned(4)));
typedef float int8_vf __attribute__((vector_size(kTileRows * 4), aligned(4)));

template <typename V, typename T>
static inline V int8_load(const T* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// The same for any instruction set, in plain vector arithmetic (GCC lowers it to the target's width): each dword's
// four quants widened to int32 lanes and multiplied by the token's.
template <int MT, int kBits, int kSub, int kOffset, bool kMin>
static inline void int8_micro(const uint8_t* quants, const float* d, const float* m, int64_t s_begin,
                              int64_t s_end, bool accumulate, const Int8Activations& x, int64_t t0, int64_t columns,
                              float* out, int64_t ldo, int64_t rows) {
  const int64_t xblocks = columns / kActivationBlock, xsums = columns / 16;
  int8_vf acc[MT];
  for (int t = 0; t < MT; ++t) {
    acc[t] = int8_vf{};
    if (accumulate)
      for (int64_t r = 0; r < rows; ++r) acc[t][r] = out[(t0 + t) * ldo + r];
  }
  for (int64_t s = s_begin; s < s_end; ++s) {
    int8_vi dot[MT];
    for (int t = 0; t < MT; ++t) dot[t] = int8_vi{};
    const int64_t k0 = s * kSub;
    const auto multiply = [&](const int8_vi w, int64_t k) __attribute__((always_inline)) {
      const int8_vi w0 = w & 0xFF, w1 = (w >> 8) & 0xFF, w2 = (w >> 16) & 0xFF, w3 = (w >> 24) & 0xFF;
      for (int t = 0; t < MT; ++t) {
        const int8_t* xq = x.quants + (t0 + t) * columns + k;
        dot[t] += w0 * (int32_t)xq[0] + w1 * (int32_t)xq[1] + w2 * (int32_t)xq[2] + w3 * (int32_t)xq[3];
      }
    };
    if constexpr (kBits == 8) {
      for (int j = 0; j < kSub / 4; ++j) multiply(int8_load<int8_vi>(quants + (k0 / 4 + j) * 64), k0 + 4 * j);
    } else {
      for (int i = 0; i < kSub / 8; ++i) {
        const int8_vi packed = int8_load<int8_vi>(quants + (k0 / 8 + i) * 64);
        multiply(packed & 0x0F0F0F0F, k0 + 8 * i);
        multiply((packed >> 4) & 0x0F0F0F0F, k0 + 8 * i + 4);
      }
    }
    const int8_vf ds = int8_load<int8_vf>(d + s * kTileRows);
    const int64_t xb = k0 / kActivationBlock;
    for (int t = 0; t < MT; ++t) {
      const int32_t* sums = x.sums + (t0 + t) * xsums + k0 / 16;
      const int32_t qsum = kSub == 32 ? sums[0] + sums[1] : sums[0];
      const float scale = x.scales[(t0 + t) * xblocks + xb];
      acc[t] += __builtin_convertvector(dot[t] - kOffset * qsum, int8_vf) * (ds * scale);
      if constexpr (kMin) acc[t] += int8_load<int8_vf>(m + s * kTileRows) * (scale * (float)qsum);
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int64_t r = 0; r < rows; ++r) out[(t0 + t) * ldo + r] = acc[t][r];
}
#endif

// Each tile's columns are taken kChunkColumns at a time, every token over a chunk before the next, so that the
// chunk's quants stay in L1 between the passes of 8 tokens (a whole row of 1536 8-bit values did not: 0.6x the speed
// of 576-value rows).
constexpr int64_t kChunkColumns = 512;

template <int kBits, int kSub, int kOffset, bool kMin>
static void int8_tiles(const Int8Activations& x, const uint8_t* quants, const float* scales, const float* mins,
                       int64_t columns, int64_t first_tile, int64_t last_tile, int64_t rows, float* out) {
  const int64_t subs = columns / kSub, tile_bytes = kTileRows * columns * kBits / 8, chunk = kChunkColumns / kSub;
  constexpr int kTokens = 8;  // tokens a pass: 8 int32 and 8 float32 accumulators of 16 lanes
  for (int64_t tile = first_tile; tile < last_tile; ++tile) {
    const uint8_t* q = quants + tile * tile_bytes;
    const float* d = scales + tile * subs * kTileRows;
    const float* m = kMin ? mins + tile * subs * kTileRows : nullptr;
    const int64_t n0 = tile * kTileRows, tile_rows = rows - n0 < kTileRows ? rows - n0 : kTileRows;
    for (int64_t s0 = 0; s0 < subs; s0 += chunk) {
      const int64_t s1 = s0 + chunk < subs ? s0 + chunk : subs;
      const bool accumulate = s0 > 0;
      int64_t t = 0;
      for (; t + kTokens <= x.tokens; t += kTokens)
        int8_micro<kTokens, kBits, kSub, kOffset, kMin>(q, d, m, s0, s1, accumulate, x, t, columns, out + n0, rows,
                                                         tile_rows);
      for (; t + 4 <= x.tokens; t += 4)
        int8_micro<4, kBits, kSub, kOffset, kMin>(q, d, m, s0, s1, accumulate, x, t, columns, out + n0, rows, tile_rows);
      for (; t < x.tokens; ++t)
        int8_micro<1, kBits, kSub, kOffset, kMin>(q, d, m, s0, s1, accumulate, x, t, columns, out + n0, rows, tile_rows);
    }
  }
}

// The loop above instantiated for the format's bits, sub-block, zero point and min.
static void matmul_tiles(const Format& format, const Int8Activations& x, const uint8_t* quants, const float* scales,
                         const float* mins, int64_t columns, int64_t first_tile, int64_t last_tile, int64_t rows,
                         float* out) {
  const auto run = [&](auto tiles) { tiles(x, quants, scales, mins, columns, first_tile, last_tile, rows, out); };
  switch (format.kind) {
    case Kind::Q4_0: case Kind::INT4: run(int8_tiles<4, 32, 8, false>); break;
    case Kind::Q4_1: case Kind::Q4_K: case Kind::UINT4_ZP: run(int8_tiles<4, 32, 0, true>); break;
    case Kind::Q5_0: run(int8_tiles<8, 32, 16, false>); break;
    case Kind::Q5_1: case Kind::Q5_K: run(int8_tiles<8, 32, 0, true>); break;
    case Kind::Q6_K: run(int8_tiles<8, 16, 32, false>); break;
    case Kind::Q8_0: case Kind::INT8: run(int8_tiles<8, 32, 128, false>); break;
  }
}

// This instruction set's int8-activation kernels, for quantized_matmul.cpp (quantized_matmul.h).
extern const Int8Kernels int8_kernels = {&quantize_activations, &pack_tile, &matmul_tiles};
