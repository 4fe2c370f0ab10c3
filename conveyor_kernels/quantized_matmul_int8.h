// The int8-activation body of the quantized matmul (llama.cpp's way of multiplying quantized weights): the step's
// tokens are quantized to int8 and multiplied by the weights' own integer quants with integer dot products, instead
// of dequantizing the weights to floats. Included inside `namespace quantized_matmul::isa_<name>` under that set's
// `#pragma GCC target(...)`, each exporting its set's `int8_kernels` (quantized_matmul.h):
// quantized_matmul_avx512_vnni.cpp with INT8_VNNI defined (AVX-512 VNNI's vpdpbusd: 64 byte products an instruction,
// against vdpbf16ps' 32 bf16 ones), quantized_matmul_avx2.cpp with INT8_AVX2 (vpmaddubsw + vpmaddwd, which AVX-512
// CPUs without VNNI run too) and quantized_matmul_portable.cpp (a plain C++ dot product).
//
// Activations: per token, per block of 32 values, scale = max |x| / 127 and q = round(x / scale), halves to even,
// in float32: exactly conveyor_kernels/quantized_matmul.py's quantize_activations_reference; and scale * sum(q) per 16 and
// per 32 values.
//
// Weights, repacked once at load (pack_tile): every format's values are d * (u - offset) + m per sub-block of 32
// values (Q6_K: 16), u an unsigned quant of at most 8 bits, offset the format's zero point where every block has the
// same (int8_offset: Q4_0 / int4 8, Q5_0 16, Q6_K 32, Q8_0 / int8 128 with u = q + 128), d and m float32: Q6_K
// d = super-block d * int8 scale; Q4_1 / Q5_1 m = the block's min; Q4_K / Q5_K the sub-block's d = super-block d *
// 6-bit scale, m = -(dmin * 6-bit min); AWQ / GPTQ m = -(zero point * scale); the others m = 0, not stored. These
// are the dequantized values exactly (the same products quantized_matmul_body.h computes). A tile of 16 rows keeps
// its quants in the order the dot product reads them: 8-bit, byte 64 j + 4 r + c is row r's value 4 j + c (dword j
// of the 16 rows in one vector); 4-bit, byte 64 i + 4 r + c holds row r's values 8 i + c (low nibble) and
// 8 i + 4 + c (high).
//
// Then per token and sub-block, one lane per row: S = sum(u * q) exactly in int32 (vpdpbusd: unsigned u by signed
// q), and out += float(S) * (d * scale_x) + m * (scale_x * sum(q)), or d * (scale_x * float(S) - offset * scale_x *
// sum(q)): four vector instructions a sub-block and token besides the dot products, their scalars read from memory.
// The VNNI body takes the offset off in integers instead, float(S - offset * sum(q)) * (d * scale_x), the operations
// of the AMX path (quantized_matmul_amx.cpp), which hands it the steps of few tokens. The roundings are those
// float32 products and sums, where the two terms partly cancel: the result is the float64 product of the quantized x
// and the dequantized weights to about float32's precision of the terms' magnitudes, in another order
// (quantized_matmul.py's matmul_int8_reference).

typedef float int8_vf16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t int8_vi16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t int8_vu16 __attribute__((vector_size(64), aligned(4)));
typedef int8_t int8_vb16 __attribute__((vector_size(16), aligned(1)));

typedef float int8_vf16_alias __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t int8_vh16_alias __attribute__((vector_size(32), aligned(2), may_alias));

#ifdef INT8_AVX2
// One block of kActivationBlock values, in AVX2 registers: GCC lowers the generic 16-float vectors below to scalar
// code there (the conversions to int8, the sums), which took 6x the matmul of a 16-row tile (16 tokens of 576).
// The same operations, so the same quants and scales.
static inline __m256 int8_load_x8(const float* x32, const uint16_t* x16, int64_t at) {
  if (x16 == nullptr) return _mm256_loadu_ps(x32 + at);
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x16 + at));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

static inline int int8_sum_lanes(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

static inline float int8_quantize_block(const float* x32, const uint16_t* x16, int64_t at, int8_t* out, int halves[2]) {
  __m256 v[4];
  __m256i largest = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    v[i] = int8_load_x8(x32, x16, at + 8 * i);
    largest = _mm256_max_epu32(largest, _mm256_and_si256(_mm256_castps_si256(v[i]), _mm256_set1_epi32(0x7FFFFFFF)));
  }
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(largest), _mm256_extracti128_si256(largest, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
  const float scale = _mm_cvtss_f32(_mm_castsi128_ps(m)) / 127.0f;
  if (!(scale > 0.0f)) {
    __builtin_memset(out, 0, kActivationBlock);
    halves[0] = halves[1] = 0;
    return scale;
  }
  const __m256 divisor = _mm256_set1_ps(scale), magic = _mm256_set1_ps(12582912.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i)
    q[i] = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(_mm256_div_ps(v[i], divisor), magic), magic));
  halves[0] = int8_sum_lanes(_mm256_add_epi32(q[0], q[1]));
  halves[1] = int8_sum_lanes(_mm256_add_epi32(q[2], q[3]));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return scale;
}
#elif defined(INT8_VNNI)
// The same operations in AVX-512 registers: the generic code below ran about 90 cycles a block here (its lane loops
// stay scalar), a tenth of a decode step's time at 16 tokens. Round to nearest even is the conversion's own mode.
static inline __m512 int8_load_x16(const float* x32, const uint16_t* x16, int64_t at) {
  if (x16 == nullptr) return _mm512_loadu_ps(x32 + at);
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + at));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

static inline float int8_quantize_block(const float* x32, const uint16_t* x16, int64_t at, int8_t* out, int halves[2]) {
  const __m512 low = int8_load_x16(x32, x16, at), high = int8_load_x16(x32, x16, at + 16);
  const __m512i sign_off = _mm512_set1_epi32(0x7FFFFFFF);  // |v|, whose bits order as the values do
  const __m512i magnitudes = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(low), sign_off),
                                              _mm512_and_si512(_mm512_castps_si512(high), sign_off));
  const uint32_t largest = _mm512_reduce_max_epu32(magnitudes);
  float amax;
  __builtin_memcpy(&amax, &largest, 4);
  const float scale = amax / 127.0f;
  if (!(scale > 0.0f)) {
    __builtin_memset(out, 0, kActivationBlock);
    halves[0] = halves[1] = 0;
    return scale;
  }
  const __m512 divisor = _mm512_set1_ps(scale);
  constexpr int kNearestEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i q_low = _mm512_cvt_roundps_epi32(_mm512_div_ps(low, divisor), kNearestEven);
  const __m512i q_high = _mm512_cvt_roundps_epi32(_mm512_div_ps(high, divisor), kNearestEven);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q_low));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(q_high));
  halves[0] = _mm512_reduce_add_epi32(q_low);
  halves[1] = _mm512_reduce_add_epi32(q_high);
  return scale;
}
#else
// 16 values of x from float32 or from bf16 bits (plain vector loads: see quantized_matmul_body.h's `load`).
static inline int8_vf16 int8_load_x(const float* x32, const uint16_t* x16, int64_t at) {
  if (x16 == nullptr) return *reinterpret_cast<const int8_vf16_alias*>(x32 + at);
  const int8_vu16 bits = __builtin_convertvector(*reinterpret_cast<const int8_vh16_alias*>(x16 + at), int8_vu16) << 16;
  return (int8_vf16)bits;  // a cast between vector types of one size keeps the bits
}

static inline float int8_max_abs(int8_vf16 a, int8_vf16 b) {
  int8_vu16 bits_a, bits_b;
  __builtin_memcpy(&bits_a, &a, 64);
  __builtin_memcpy(&bits_b, &b, 64);
  bits_a &= 0x7FFFFFFFu;  // |v|, whose bits order as the values do
  bits_b &= 0x7FFFFFFFu;
  const int8_vu16 larger = bits_a > bits_b ? bits_a : bits_b;
  uint32_t m = 0;
  for (int i = 0; i < 16; ++i) m = larger[i] > m ? larger[i] : m;
  float amax;
  __builtin_memcpy(&amax, &m, 4);
  return amax;
}

// 16 values' quants (round(v / scale), halves to even: adding and removing 1.5 * 2^23 rounds in the default mode, as
// torch.round does), stored as int8; returns their sum.
static inline int int8_quantize_16(int8_vf16 v, float scale, int8_t* out) {
  const int8_vf16 r = (v / scale + 12582912.0f) - 12582912.0f;
  const int8_vi16 q = __builtin_convertvector(r, int8_vi16);
  const int8_vb16 bytes = __builtin_convertvector(q, int8_vb16);
  __builtin_memcpy(out, &bytes, 16);
  int sum = 0;
  for (int i = 0; i < 16; ++i) sum += q[i];
  return sum;
}

// One block of kActivationBlock values at x[at]: writes its quants and the sums of each 16, returns its scale.
static inline float int8_quantize_block(const float* x32, const uint16_t* x16, int64_t at, int8_t* out, int halves[2]) {
  const int8_vf16 low = int8_load_x(x32, x16, at), high = int8_load_x(x32, x16, at + 16);
  const float scale = int8_max_abs(low, high) / 127.0f;  // |x / scale| <= 127 after rounding: no clamp
  if (scale > 0.0f) {
    halves[0] = int8_quantize_16(low, scale, out);
    halves[1] = int8_quantize_16(high, scale, out + 16);
  } else {
    __builtin_memset(out, 0, kActivationBlock);
    halves[0] = halves[1] = 0;
  }
  return scale;
}
#endif

static void quantize_activations(const float* x32, const uint16_t* x16, int64_t tokens, int64_t columns,
                                 int8_t* quants, float* scales, float* scaled_sums16, float* scaled_sums32,
                                 int32_t* sums16, int32_t* sums32) {
  const int64_t blocks = columns / kActivationBlock;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = t * columns + b * kActivationBlock;
      int halves[2];
      const float scale = int8_quantize_block(x32, x16, at, quants + at, halves);
      scales[t * blocks + b] = scale;
      scaled_sums16[t * 2 * blocks + 2 * b] = scale * (float)halves[0];
      scaled_sums16[t * 2 * blocks + 2 * b + 1] = scale * (float)halves[1];
      scaled_sums32[t * blocks + b] = scale * (float)(halves[0] + halves[1]);
      sums16[t * 2 * blocks + 2 * b] = halves[0];
      sums16[t * 2 * blocks + 2 * b + 1] = halves[1];
      sums32[t * blocks + b] = halves[0] + halves[1];
    }
  }
}

// One weight row's unsigned quants u (`columns` of them), with each sub-block's d and m (0 for the formats without
// a min) written `stride` floats apart (a tile keeps its 16 rows' values of a sub-block together).
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
  float* zeros = int8_has_min(format.kind) ? nullptr : new float[subs * kTileRows];  // their m: all 0
  float* m = zeros ? zeros : mins;
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
  delete[] zeros;
}

// The line `ahead` bytes past `line`, into L1. A tile's first pass reads each of its lines from memory (a step
// streams the whole model's weights, more than L3 holds) while its later passes find them in L1: that first pass
// (kPrefetch; the other passes are instantiated without it, where the distance's register spilled others: 1.06x the
// time at 64 tokens) prefetches the lines two tiles on, which overlaps their reads with its work. One matmul over
// SmolLM2's layer shapes, 30 layers' weights in turn, on the AVX2-only EPYC: Q8_0 0.86x-0.88x the time at 4 and 8
// tokens, 0.94x at 16; Q4_1 0.90x and 0.94x. Steps of more than kPrefetchTokens (quantized_matmul.h) prefetch none.
template <bool kPrefetch>
static inline void int8_prefetch(const uint8_t* line, int64_t ahead) {
  if constexpr (kPrefetch) __builtin_prefetch(line + ahead, 0, 3);
}

#ifdef INT8_VNNI
#include "quantized_matmul_int8_scale.h"

// acc + the dot products of w's unsigned bytes with the 4 signed bytes at x, broadcast to every lane: the broadcast
// folded into the instruction (a {1to16} memory operand). GCC emitted a separate vpbroadcastd for each, as many
// instructions again as the dot products themselves.
static inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

constexpr int kInt8Tokens = 8;  // tokens a pass: 8 int32 and 8 float32 accumulators of 16 lanes
#define INT8_KEEP_CHAINS

// out[t0 .. t0 + MT, 0 .. rows) for MT tokens and one tile's 16 rows (an int32 / float32 lane each), prefetching
// `prefetch` bytes past each line it reads where kPrefetch (int8_prefetch; the other paths' int8_micro the same).
template <int MT, int kLargest, int kSub, bool kMin, bool kPrefetch>
static inline void int8_micro(const uint8_t* quants, const float* d, const float* m, float offset, int64_t s_begin,
                              int64_t s_end, bool accumulate, const Int8Activations& x, int64_t t0, int64_t columns,
                              float* out, int64_t ldo, int64_t rows, int64_t prefetch) {
  const int64_t xblocks = columns / kActivationBlock;
  constexpr int kBits = int8_bits_of(kLargest);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __mmask16 mask = (__mmask16)((1u << rows) - 1);
  const int32_t zero_point = (int32_t)offset;
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = accumulate ? _mm512_maskz_loadu_ps(mask, out + (t0 + t) * ldo) : _mm512_setzero_ps();
  for (int64_t s = s_begin; s < s_end; ++s) {
    __m512i dot[MT];
    for (int t = 0; t < MT; ++t) dot[t] = _mm512_setzero_si512();
    const int64_t k0 = s * kSub;
    const auto multiply = [&](const __m512i w, int64_t k) __attribute__((always_inline)) {
      for (int t = 0; t < MT; ++t) dot[t] = dpbusd_broadcast(dot[t], w, x.quants + (t0 + t) * columns + k);
    };
    if constexpr (kBits == 8) {
      for (int j = 0; j < kSub / 4; ++j) {
        int8_prefetch<kPrefetch>(quants + (k0 / 4 + j) * 64, prefetch);
        multiply(_mm512_loadu_si512(quants + (k0 / 4 + j) * 64), k0 + 4 * j);
      }
    } else {
      for (int i = 0; i < kSub / 8; ++i) {
        int8_prefetch<kPrefetch>(quants + (k0 / 8 + i) * 64, prefetch);
        const __m512i packed = _mm512_loadu_si512(quants + (k0 / 8 + i) * 64);
        multiply(_mm512_and_si512(packed, low_nibbles), k0 + 8 * i);
        multiply(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles), k0 + 8 * i + 4);
      }
    }
    const __m512 ds = _mm512_loadu_ps(d + s * kTileRows);
    const float* scaled_sums = kSub == 32 ? x.scaled_sums32 + s : x.scaled_sums16 + s;
    const int32_t* sums = kSub == 32 ? x.sums32 + s : x.sums16 + s;
    const int64_t xb = k0 / kActivationBlock, sums_per_token = columns / kSub;
    for (int t = 0; t < MT; ++t) {
      const float scale = x.scales[(t0 + t) * xblocks + xb];
      if constexpr (kMin) {
        acc[t] = int8_add_scaled_sums<true>(acc[t], dot[t], ds, scale, m + s * kTileRows,
                                            scaled_sums[(t0 + t) * sums_per_token]);
      } else {  // the signed sum S - offset * sum(q), exactly
        const __m512i offsets = _mm512_set1_epi32(zero_point * sums[(t0 + t) * sums_per_token]);
        acc[t] = int8_add_scaled_sums<false>(acc[t], _mm512_sub_epi32(dot[t], offsets), ds, scale, nullptr, 0.0f);
      }
    }
  }
  for (int t = 0; t < MT; ++t) _mm512_mask_storeu_ps(out + (t0 + t) * ldo, mask, acc[t]);
}
#elif defined(INT8_AVX2)
// AVX2 without VNNI: vpmaddubsw multiplies unsigned by signed bytes into int16 pairs (saturating) and vpmaddwd sums
// the pairs into int32 lanes. Quants of up to 6 bits go in as they are; the 8-bit formats (u = q + 128) take
// llama.cpp's sign trick, |q| times x with q's sign, which gives the signed sum itself, so their zero point is not
// subtracted again. The narrow formats add several dwords' int16 pairs first (vpaddw) and widen them once, one
// vpmaddwd and one vpaddd a group instead of a dword: a pair is at most 2 * largest * 127, and
// int8_pairs_per_widen of them stay inside int16 (4-bit: 8, a whole sub-block; 5-bit: 4; 6-bit: 2; the sign trick's
// 2 * 128 * 127: 1). A pass takes half the tile's rows (8 lanes) and 4 tokens, so that the accumulators fit AVX2's
// 16 registers.
constexpr int kInt8Tokens = 4;

// GCC reassociates each token's chain of vpaddw into a tree, which keeps all of a sub-block's products alive at once
// and spills them to the stack; without tree reassociation the sums stay chains in registers. The register-pressure
// aware scheduling before allocation (off by default on x86) then halves the Q8_0 loop's stack moves (121 -> 61 in
// the function): one matmul of 16 tokens 0.77x-0.96x the time, by format (Q4_K, Q4_1 most; the same sums).
#define INT8_KEEP_CHAINS __attribute__((optimize("no-tree-reassoc", "schedule-insns", "sched-pressure")))

constexpr int int8_pairs_per_widen(int largest) { return 32767 / (2 * (largest == 255 ? 128 : largest) * 127); }

static inline __m256i int8_lane_mask(int64_t lanes) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int MT, int kLargest, int kSub, bool kMin, bool kPrefetch>
INT8_KEEP_CHAINS static inline void int8_micro(const uint8_t* quants, const float* d, const float* m, float offset,
                                               int64_t s_begin, int64_t s_end, bool accumulate,
                                               const Int8Activations& x, int64_t t0, int64_t columns, float* out,
                                               int64_t ldo, int64_t rows, int64_t prefetch) {
  const int64_t xblocks = columns / kActivationBlock;
  constexpr int kBits = int8_bits_of(kLargest);
  constexpr bool kSignTrick = kLargest == 255;
  constexpr int kDwords = kSub / 4, kWiden = int8_pairs_per_widen(kLargest) < kDwords ? int8_pairs_per_widen(kLargest)
                                                                                          : kDwords;
  static_assert(kWiden >= 1 && kDwords % kWiden == 0, "a sub-block's dwords widen in equal groups");
  const __m256 zero_point = _mm256_set1_ps(offset);
  const __m256i ones = _mm256_set1_epi16(1), low_nibbles = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
  for (int half = 0; half < 2 && rows > 8 * half; ++half) {
    // Whole halves load and store plainly: vmaskmovps stores are slow on AMD's cores.
    const bool whole = rows >= 8 * (half + 1);
    const __m256i mask = int8_lane_mask(rows - 8 * half);
    __m256 acc[MT];
    for (int t = 0; t < MT; ++t) {
      float* o = out + (t0 + t) * ldo + 8 * half;
      acc[t] = !accumulate ? _mm256_setzero_ps() : whole ? _mm256_loadu_ps(o) : _mm256_maskload_ps(o, mask);
    }
    for (int64_t s = s_begin; s < s_end; ++s) {
      __m256i dot[MT], pairs[MT];
      const int64_t k0 = s * kSub;
      // dword j (4 values of each of the 8 rows) times each token's 4 quants at k0 + 4 j, into the int16 pairs
      const auto multiply = [&](const __m256i w, int j) __attribute__((always_inline)) {
        __m256i magnitude, q;
        if constexpr (kSignTrick) {
          q = _mm256_xor_si256(w, flip);  // q = u - 128
          magnitude = _mm256_abs_epi8(q);
        }
        for (int t = 0; t < MT; ++t) {
          int32_t xq;
          __builtin_memcpy(&xq, x.quants + (t0 + t) * columns + k0 + 4 * j, 4);
          const __m256i product = kSignTrick ? _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_set1_epi32(xq), q))
                                             : _mm256_maddubs_epi16(w, _mm256_set1_epi32(xq));
          pairs[t] = j % kWiden == 0 ? product : _mm256_add_epi16(pairs[t], product);
        }
        if (j % kWiden == kWiden - 1) {
          for (int t = 0; t < MT; ++t) {
            const __m256i widened = _mm256_madd_epi16(pairs[t], ones);
            dot[t] = j == kWiden - 1 ? widened : _mm256_add_epi32(dot[t], widened);
          }
        }
      };
      // Unrolled whole, so that which dwords start and end a widening group is known at compile time.
      if constexpr (kBits == 8) {
#pragma GCC unroll 8
        for (int j = 0; j < kDwords; ++j) {
          if (half == 0) int8_prefetch<kPrefetch>(quants + (k0 / 4 + j) * 64, prefetch);  // both halves' line
          multiply(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + (k0 / 4 + j) * 64 + 32 * half)), j);
        }
      } else {
#pragma GCC unroll 4
        for (int i = 0; i < kDwords / 2; ++i) {
          if (half == 0) int8_prefetch<kPrefetch>(quants + (k0 / 8 + i) * 64, prefetch);
          const __m256i packed =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + (k0 / 8 + i) * 64 + 32 * half));
          multiply(_mm256_and_si256(packed, low_nibbles), 2 * i);
          multiply(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles), 2 * i + 1);
        }
      }
      const __m256 ds = _mm256_loadu_ps(d + s * kTileRows + 8 * half);
      const float* scaled_sums = kSub == 32 ? x.scaled_sums32 + s : x.scaled_sums16 + s;
      const int64_t xb = k0 / kActivationBlock, sums_per_token = columns / kSub;
      for (int t = 0; t < MT; ++t) {
        const __m256 scale = _mm256_set1_ps(x.scales[(t0 + t) * xblocks + xb]);
        const __m256 scaled_sum = _mm256_set1_ps(scaled_sums[(t0 + t) * sums_per_token]);
        if constexpr (kMin) {
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(ds, scale), acc[t]);
          acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(m + s * kTileRows + 8 * half), scaled_sum, acc[t]);
        } else if constexpr (kSignTrick) {  // the signed sum itself: no zero point to take off
          acc[t] = _mm256_fmadd_ps(ds, _mm256_mul_ps(_mm256_cvtepi32_ps(dot[t]), scale), acc[t]);
        } else {
          const __m256 shifted = _mm256_fnmadd_ps(zero_point, scaled_sum, _mm256_mul_ps(_mm256_cvtepi32_ps(dot[t]), scale));
          acc[t] = _mm256_fmadd_ps(ds, shifted, acc[t]);
        }
      }
    }
    for (int t = 0; t < MT; ++t) {
      float* o = out + (t0 + t) * ldo + 8 * half;
      whole ? _mm256_storeu_ps(o, acc[t]) : _mm256_maskstore_ps(o, mask, acc[t]);
    }
  }
}
#else
typedef int32_t int8_vi __attribute__((vector_size(kTileRows * 4), aligned(4)));
typedef float int8_vf __attribute__((vector_size(kTileRows * 4), aligned(4)));

typedef int32_t int8_vi_alias __attribute__((vector_size(kTileRows * 4), aligned(4), may_alias));
typedef float int8_vf_alias __attribute__((vector_size(kTileRows * 4), aligned(4), may_alias));

// Plain vector loads, not memcpy (see quantized_matmul_body.h's `load`).
static inline int8_vi int8_load_ints(const void* p) { return *reinterpret_cast<const int8_vi_alias*>(p); }
static inline int8_vf int8_load_floats(const float* p) { return *reinterpret_cast<const int8_vf_alias*>(p); }

constexpr int kInt8Tokens = 8;
#define INT8_KEEP_CHAINS

// The same for any instruction set, in plain vector arithmetic (GCC lowers it to the target's width): each dword's
// four quants widened to int32 lanes and multiplied by the token's.
template <int MT, int kLargest, int kSub, bool kMin, bool kPrefetch>
static inline void int8_micro(const uint8_t* quants, const float* d, const float* m, float offset, int64_t s_begin,
                              int64_t s_end, bool accumulate, const Int8Activations& x, int64_t t0, int64_t columns,
                              float* out, int64_t ldo, int64_t rows, int64_t prefetch) {
  const int64_t xblocks = columns / kActivationBlock;
  constexpr int kBits = int8_bits_of(kLargest);
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
      for (int j = 0; j < kSub / 4; ++j) {
        int8_prefetch<kPrefetch>(quants + (k0 / 4 + j) * 64, prefetch);
        multiply(int8_load_ints(quants + (k0 / 4 + j) * 64), k0 + 4 * j);
      }
    } else {
      for (int i = 0; i < kSub / 8; ++i) {
        int8_prefetch<kPrefetch>(quants + (k0 / 8 + i) * 64, prefetch);
        const int8_vi packed = int8_load_ints(quants + (k0 / 8 + i) * 64);
        multiply(packed & 0x0F0F0F0F, k0 + 8 * i);
        multiply((packed >> 4) & 0x0F0F0F0F, k0 + 8 * i + 4);
      }
    }
    const int8_vf ds = int8_load_floats(d + s * kTileRows);
    const float* scaled_sums = kSub == 32 ? x.scaled_sums32 + s : x.scaled_sums16 + s;
    const int64_t xb = k0 / kActivationBlock, sums_per_token = columns / kSub;
    for (int t = 0; t < MT; ++t) {
      const float scale = x.scales[(t0 + t) * xblocks + xb], scaled_sum = scaled_sums[(t0 + t) * sums_per_token];
      if constexpr (kMin) {
        acc[t] += __builtin_convertvector(dot[t], int8_vf) * (ds * scale);
        acc[t] += int8_load_floats(m + s * kTileRows) * scaled_sum;
      } else {
        acc[t] += ds * (__builtin_convertvector(dot[t], int8_vf) * scale - offset * scaled_sum);
      }
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

template <int kLargest, int kSub, bool kMin>
INT8_KEEP_CHAINS static void int8_tiles(const Int8Activations& x, const uint8_t* quants, const float* scales,
                                        const float* mins, float offset, int64_t columns, int64_t first_tile,
                                        int64_t last_tile, int64_t rows, float* out) {
  const int64_t subs = columns / kSub, tile_bytes = kTileRows * columns * int8_bits_of(kLargest) / 8;
  const int64_t chunk = kChunkColumns / kSub;
  constexpr int kTokens = kInt8Tokens;
  for (int64_t tile = first_tile; tile < last_tile; ++tile) {
    const uint8_t* q = quants + tile * tile_bytes;
    const float* d = scales + tile * subs * kTileRows;
    const float* m = kMin ? mins + tile * subs * kTileRows : nullptr;
    const int64_t n0 = tile * kTileRows, tile_rows = rows - n0 < kTileRows ? rows - n0 : kTileRows;
    for (int64_t s0 = 0; s0 < subs; s0 += chunk) {
      const int64_t s1 = s0 + chunk < subs ? s0 + chunk : subs;
      const bool accumulate = s0 > 0;
      // by the first full pass only, in steps of few tokens (int8_prefetch; 1 token a step gained nothing from it)
      const int64_t ahead = x.tokens <= kPrefetchTokens && tile + 2 < last_tile ? 2 * tile_bytes : 0;
      int64_t t = 0;
      for (; t + kTokens <= x.tokens; t += kTokens) {
        if (t == 0 && ahead != 0)
          int8_micro<kTokens, kLargest, kSub, kMin, true>(q, d, m, offset, s0, s1, accumulate, x, t, columns, out + n0,
                                                          rows, tile_rows, ahead);
        else
          int8_micro<kTokens, kLargest, kSub, kMin, false>(q, d, m, offset, s0, s1, accumulate, x, t, columns,
                                                           out + n0, rows, tile_rows, 0);
      }
      // The rest in one pass (two on VNNI's 8): a pass of 2 or 3 tokens reads the chunk's quants once where one
      // token a pass read them as often as there are tokens (3 tokens of Q8_0 3072 x 576 on AVX2: 0.81x the time).
      const auto pass = [&](auto tokens) __attribute__((always_inline)) {
        int8_micro<decltype(tokens)::value, kLargest, kSub, kMin, false>(q, d, m, offset, s0, s1, accumulate, x, t,
                                                                         columns, out + n0, rows, tile_rows, 0);
        t += decltype(tokens)::value;
      };
      if (kTokens > 4 && t + 4 <= x.tokens) pass(std::integral_constant<int, 4>{});
      switch (x.tokens - t) {
        case 3: pass(std::integral_constant<int, 3>{}); break;
        case 2: pass(std::integral_constant<int, 2>{}); break;
        case 1: pass(std::integral_constant<int, 1>{}); break;
      }
    }
  }
}

// The loop above instantiated for the format's largest quant, values a sub-block and offsets.
static void matmul_tiles(const Format& format, const Int8Activations& x, const uint8_t* quants, const float* scales,
                         const float* mins, int64_t columns, int64_t first_tile, int64_t last_tile, int64_t rows,
                         float* out) {
  const float offset = (float)int8_offset(format.kind);
  const auto run = [&](auto tiles) { tiles(x, quants, scales, mins, offset, columns, first_tile, last_tile, rows, out); };
  const bool has_min = int8_has_min(format.kind);
  switch (int8_largest_quant(format.kind)) {
    case 15: has_min ? run(int8_tiles<15, 32, true>) : run(int8_tiles<15, 32, false>); break;
    case 31: has_min ? run(int8_tiles<31, 32, true>) : run(int8_tiles<31, 32, false>); break;
    case 63: run(int8_tiles<63, 16, false>); break;  // Q6_K
    default: run(int8_tiles<255, 32, false>); break;  // Q8_0, int8
  }
}

// This instruction set's int8-activation kernels, for quantized_matmul.cpp (quantized_matmul.h).
extern const Int8Kernels int8_kernels = {&quantize_activations, &pack_tile, &matmul_tiles};
#undef INT8_KEEP_CHAINS
