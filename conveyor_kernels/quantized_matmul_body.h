// The body of the quantized matmul kernels, compiled once per instruction set, each in its own file
// (quantized_matmul_avx512.cpp, _avx2.cpp, _portable.cpp), which includes it inside
// `namespace quantized_matmul::isa_<name>` under `#pragma GCC target(...)` with VEC_FLOATS set to the vector width
// (16 floats for AVX-512, 8 for AVX2, 4 for the portable build, which GCC lowers to SSE2 on x86-64 and to NEON or
// scalar code elsewhere); it exports its set's `row_kernels` (quantized_matmul.h). Written with GCC's vector
// extensions, so one text serves every width.
//
// Dequantization follows gguf-py's `gguf.quants.dequantize` (and ggml's dequantize_row_*) operation for
// operation: every product below is of a float16 scale (11 significant bits) by a small integer, or of such a
// product by a 6-bit sub-scale, so it is exact in float32 and fused multiply-adds give the same floats as
// separate roundings. The values are bit for bit gguf-py's.

typedef float vf __attribute__((vector_size(VEC_FLOATS * 4), aligned(4)));  // unaligned loads allowed
typedef float vf_alias __attribute__((vector_size(VEC_FLOATS * 4), aligned(4), may_alias));

// A plain (unaligned) vector load. Not a memcpy into a vf: for 32-byte vectors GCC's generic tuning, which splits
// unaligned AVX loads in two, then copied through the stack, and the 16-byte stores each load waited for made the
// AVX2 path 14x slower than the AVX-512 one (1536 x 576 Q8_0, 16 tokens, AMD EPYC).
static inline vf load(const float* p) { return *reinterpret_cast<const vf_alias*>(p); }

static inline float sum_lanes(vf v) {
  float s = 0.0f;
  for (int i = 0; i < VEC_FLOATS; ++i) s += v[i];
  return s;
}

static void dequant_q4_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)((int)(qs[j] & 0x0F) - 8);
    y[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
  }
}

static void dequant_q4_1(const uint8_t* b, float* y) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)(qs[j] & 0x0F) + m;
    y[j + 16] = d * (float)(qs[j] >> 4) + m;
  }
}

static void dequant_q5_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  uint32_t qh;
  __builtin_memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int low = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    const int high = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * (float)(low - 16);
    y[j + 16] = d * (float)(high - 16);
  }
}

static void dequant_q5_1(const uint8_t* b, float* y) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  uint32_t qh;
  __builtin_memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int low = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    const int high = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * (float)low + m;
    y[j + 16] = d * (float)high + m;
  }
}

static void dequant_q8_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = (float)qs[j] * d;
}

// The scales and mins of the two 32-value sub-blocks of chunk `chunk` (64 values) of a Q4_K / Q5_K super-block:
// {scale 1, min 1, scale 2, min 2}, each the super-block's f16 d (or dmin) times a 6-bit integer.
struct SubScales {
  float d1, min1, d2, min2;
};

static inline SubScales k_quant_sub_scales(const uint8_t* b, int chunk) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  int sc1, m1, sc2, m2;
  scale_min_k4(2 * chunk, b + 4, &sc1, &m1);
  scale_min_k4(2 * chunk + 1, b + 4, &sc2, &m2);
  return {d * (float)sc1, dmin * (float)m1, d * (float)sc2, dmin * (float)m2};
}

static void dequant_q4_k(const uint8_t* b, float* y) {
  const uint8_t* q = b + 16;
  for (int chunk = 0; chunk < 4; ++chunk, q += 32, y += 64) {
    const SubScales s = k_quant_sub_scales(b, chunk);
    const float d1 = s.d1, min1 = s.min1, d2 = s.d2, min2 = s.min2;
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * (float)(q[l] & 0x0F) - min1;
      y[l + 32] = d2 * (float)(q[l] >> 4) - min2;
    }
  }
}

static void dequant_q5_k(const uint8_t* b, float* y) {
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int chunk = 0; chunk < 4; ++chunk, ql += 32, y += 64) {
    const SubScales s = k_quant_sub_scales(b, chunk);
    const float d1 = s.d1, min1 = s.min1, d2 = s.d2, min2 = s.min2;
    const int bit1 = 2 * chunk, bit2 = 2 * chunk + 1;
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * (float)((ql[l] & 0x0F) | (((qh[l] >> bit1) & 1) << 4)) - min1;
      y[l + 32] = d2 * (float)((ql[l] >> 4) | (((qh[l] >> bit2) & 1) << 4)) - min2;
    }
  }
}

static void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = (d * (float)sc[is]) * (float)q1;
      y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
      y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
      y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
    }
  }
}

// Weight-only int8 / int4 groups (engine/quantization/weight_only.py): a float32 scale, then `group` int8
// values, or `group / 2` bytes whose low nibbles hold the first half of the group and high nibbles the second
// (each the value + 8).
static void dequant_int8_group(const uint8_t* b, float* y, int group) {
  float scale;
  __builtin_memcpy(&scale, b, 4);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 4);
  for (int j = 0; j < group; ++j) y[j] = scale * (float)q[j];
}

static void dequant_int4_group(const uint8_t* b, float* y, int group) {
  float scale;
  __builtin_memcpy(&scale, b, 4);
  const uint8_t* q = b + 4;
  const int half = group / 2;
  for (int j = 0; j < half; ++j) {
    y[j] = scale * (float)((int)(q[j] & 0x0F) - 8);
    y[j + half] = scale * (float)((int)(q[j] >> 4) - 8);
  }
}

// AWQ / GPTQ 4-bit groups with a zero point (engine/quantization/w4a16.py repacks the checkpoint's into these): a
// float32 scale, the uint8 zero point (0..16: GPTQ v1 stores it minus one), then `group / 2` bytes whose low
// nibbles hold the first half of the group and high nibbles the second. (q - zero) is a small integer, so with
// the checkpoints' float16 scales every product is exact: the value is the formats' own (q - zero) * scale.
static void dequant_uint4_zp_group(const uint8_t* b, float* y, int group) {
  float scale;
  __builtin_memcpy(&scale, b, 4);
  const int zero = b[4];
  const uint8_t* q = b + 5;
  const int half = group / 2;
  for (int j = 0; j < half; ++j) {
    y[j] = scale * (float)((int)(q[j] & 0x0F) - zero);
    y[j + half] = scale * (float)((int)(q[j] >> 4) - zero);
  }
}

// One row of `columns` values from its blocks.
static void dequantize_row(const Format& format, const uint8_t* row, float* y, int64_t columns) {
  const int64_t blocks = columns / format.block_values;
  for (int64_t i = 0; i < blocks; ++i, row += format.block_bytes, y += format.block_values) {
    switch (format.kind) {
      case Kind::Q4_0: dequant_q4_0(row, y); break;
      case Kind::Q4_1: dequant_q4_1(row, y); break;
      case Kind::Q5_0: dequant_q5_0(row, y); break;
      case Kind::Q5_1: dequant_q5_1(row, y); break;
      case Kind::Q8_0: dequant_q8_0(row, y); break;
      case Kind::Q4_K: dequant_q4_k(row, y); break;
      case Kind::Q5_K: dequant_q5_k(row, y); break;
      case Kind::Q6_K: dequant_q6_k(row, y); break;
      case Kind::INT8: dequant_int8_group(row, y, format.block_values); break;
      case Kind::INT4: dequant_int4_group(row, y, format.block_values); break;
      case Kind::UINT4_ZP: dequant_uint4_zp_group(row, y, format.block_values); break;
    }
  }
}

static void dequantize_rows(const Format& format, const uint8_t* weight, int64_t row_bytes, int64_t columns,
                            int64_t begin, int64_t end, float* out) {
  for (int64_t r = begin; r < end; ++r) dequantize_row(format, weight + r * row_bytes, out + r * columns, columns);
}

// out[m, n] for the tokens [m0, m0 + MT) and the dequantized rows tile[0..RT) (output columns n0..n0 + RT).
template <int MT, int RT>
static inline void micro_tile(const float* x, int64_t ldx, const float* tile, int64_t k, float* out, int64_t ldo) {
  vf acc[MT][RT];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < RT; ++r) acc[m][r] = vf{};
  int64_t i = 0;
  for (; i + VEC_FLOATS <= k; i += VEC_FLOATS) {
    vf w[RT];
    for (int r = 0; r < RT; ++r) w[r] = load(tile + r * k + i);
    for (int m = 0; m < MT; ++m) {
      const vf xv = load(x + m * ldx + i);
      for (int r = 0; r < RT; ++r) acc[m][r] += xv * w[r];
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int r = 0; r < RT; ++r) {
      float s = sum_lanes(acc[m][r]);
      for (int64_t j = i; j < k; ++j) s += x[m * ldx + j] * tile[r * k + j];
      out[m * ldo + r] = s;
    }
  }
}

template <int RT>
static void tile_times_tokens(const float* x, int64_t tokens, const float* tile, int64_t k, float* out, int64_t ldo) {
  // MT x RT accumulators, RT weight vectors and an x vector in registers: 4 x 4 fits AVX-512's 32; AVX2's and SSE's
  // 16 take 2 tokens (4 spilled the accumulators: 2 tokens measured 0.85x-0.91x the time on AVX2, 16 tokens).
  constexpr int kTokens = VEC_FLOATS >= 16 ? 4 : 2;
  int64_t m = 0;
  for (; m + kTokens <= tokens; m += kTokens) micro_tile<kTokens, RT>(x + m * k, k, tile, k, out + m * ldo, ldo);
  for (; m < tokens; ++m) micro_tile<1, RT>(x + m * k, k, tile, k, out + m * ldo, ldo);
}

// out[:, begin:end] = x @ dequantize(weight[begin:end]).T, a tile of kTileRows rows dequantized at a time into
// `scratch` (kTileRows * columns floats) and multiplied by every token while it sits in L1/L2.
static void matmul_rows(const Format& format, const float* x, int64_t tokens, const uint8_t* weight,
                        int64_t row_bytes, int64_t columns, int64_t begin, int64_t end, float* out,
                        int64_t out_columns, float* scratch) {
  for (int64_t n0 = begin; n0 < end; n0 += kTileRows) {
    const int64_t rows = end - n0 < kTileRows ? end - n0 : kTileRows;
    dequantize_rows(format, weight + n0 * row_bytes, row_bytes, columns, 0, rows, scratch);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) tile_times_tokens<4>(x, tokens, scratch + r * columns, columns, out + n0 + r, out_columns);
    for (; r < rows; ++r) tile_times_tokens<1>(x, tokens, scratch + r * columns, columns, out + n0 + r, out_columns);
  }
}

// This instruction set's row kernels, for quantized_matmul.cpp (quantized_matmul.h).
extern const RowKernels row_kernels = {&dequantize_rows, &matmul_rows};
