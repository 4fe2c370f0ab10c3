// The int8-activation matmul on AMX tiles (Intel Xeons since Sapphire Rapids): the sums of quantized_matmul_int8.h,
// with each sub-block's integer dot products of up to 16 tokens by a tile's 16 weight rows done by one tile product
// (16 x 16 x 32) instead of 32-64 vpdpbusd. The activations' quantization and the weights' repack are VNNI's
// (quantized_matmul.cpp takes them from it): pack_tile's order, byte 64 j + 4 r + c = row r's value 4 j + c, is
// already the layout of an AMX B tile (K / 4 rows of 16 rows' dwords). Per tile and chunk of columns the B rows are
// staged once for every token group: the formats whose zero point is the same in every block as signed u - offset
// (tdpbssd; so the sum is S - offset * sum(q) itself), the 4-bit formats' nibbles split into bytes.
//
// Why the tiles' products go through memory: every sub-block has its own scales (the weights' d per row, the
// activations' per token), so its int32 sums are converted and scaled on their own: a stored C tile, then an
// epilogue of AVX-512 vectors, float(S) * (d * scale) (+ m * scale * sum(q)) per token and sub-block in sub-block
// order (quantized_matmul_int8_scale.h). The VNNI body adds the same integers with it, so a token's outputs are the
// same bit for bit whichever of the two runs its step (steps of fewer than kAmxFromTokens go to VNNI) and whatever
// the step's other tokens (tests/kernels/test_quantized_matmul.py checks it). The cost on tiles is that epilogue and
// the tile loads and stores, not the products: one 1536 x 576 Q8_0 matmul of 64 tokens 0.28 ms against VNNI's 0.36
// and oneDNN bf16's 0.23 on AMX; 16 tokens, which stream the weights from memory, 0.11 against 0.13 and 0.18.
#include <immintrin.h>

#include "quantized_matmul.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,amx-tile,amx-int8")
namespace quantized_matmul::isa_amx_int8 {
#include "quantized_matmul_int8_scale.h"

namespace {

constexpr int kGroupTokens = 16;         // an A tile's rows: the tokens one tile product multiplies
constexpr int64_t kChunkColumns = 256;   // a tile's columns taken at a time: their products, 8-16 KiB, stay in L1
constexpr int kMaxChunkSubs = kChunkColumns / 16;
constexpr int kProductsPerSub = kGroupTokens * kTileRows;  // int32 sums a stored C tile holds
// Steps of fewer tokens go to the VNNI body, whose operations are the same: a tile product's loads, stores and
// configured rows cost as much for 1 token as for 16 (one 1536 x 576 Q8_0 matmul of 1 token 0.089 ms on tiles, 0.078
// with VNNI; 10 tokens 0.096 / 0.104; 16 tokens 0.111 / 0.126, on a Xeon with AMX).
constexpr int64_t kAmxFromTokens = 12;

// The tile configuration ldtilecfg reads (palette 1: 8 tiles of up to 16 rows of 64 bytes).
struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// tmm0 / tmm1: C, `tokens` x 16 int32 sums; tmm2 / tmm3: A, `tokens` x kSub int8 quants; tmm4 / tmm5: B, kSub / 4
// rows of 16 weight rows' dwords. Two of each, so that two sub-blocks' products are in flight at once.
void configure(int tokens, int sub) {
  TileConfig config{};
  config.palette = 1;
  for (int i = 0; i < 2; ++i) {
    config.rows[i] = (uint8_t)tokens;
    config.bytes_per_row[i] = 64;
    config.rows[2 + i] = (uint8_t)tokens;
    config.bytes_per_row[2 + i] = (uint16_t)sub;
    config.rows[4 + i] = (uint8_t)(sub / 4);
    config.bytes_per_row[4 + i] = 64;
  }
  _tile_loadconfig(&config);
}

// The B rows of sub-blocks [s0, s1) of a tile for the tile product: the formats with a zero point the same in every
// block (kSigned) as signed bytes u - offset, which tdpbssd multiplies (so the epilogue has no offset term to take
// off); the 4-bit formats' nibbles split into bytes (line i's low nibbles are dword 2 i of the 16 rows, its high ones
// dword 2 i + 1). Else (5- and 6-bit formats with a min) the packed bytes themselves.
template <int kLargest, int kSub, bool kSigned>
inline const uint8_t* b_rows(const uint8_t* q, int64_t s0, int64_t s1, float offset, uint8_t* staging) {
  constexpr bool kNibbles = int8_bits_of(kLargest) == 4;
  if constexpr (kNibbles) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F), zero_point = _mm512_set1_epi8(kSigned ? (char)(int)offset : 0);
    const uint8_t* packed = q + s0 * kSub * 8;
    for (int64_t i = 0; i < (s1 - s0) * kSub / 8; ++i) {
      const __m512i line = _mm512_loadu_si512(packed + 64 * i);
      _mm512_store_si512(staging + 128 * i, _mm512_sub_epi8(_mm512_and_si512(line, low_nibbles), zero_point));
      _mm512_store_si512(staging + 128 * i + 64,
                         _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(line, 4), low_nibbles), zero_point));
    }
    return staging;
  } else if constexpr (kSigned) {
    const __m512i zero_point = _mm512_set1_epi8((char)(int)offset);  // 128 wraps to -128: u - 128 = u ^ 0x80
    const uint8_t* packed = q + s0 * kSub * 16;
    for (int64_t i = 0; i < (s1 - s0) * kSub / 4; ++i)
      _mm512_store_si512(staging + 64 * i, _mm512_sub_epi8(_mm512_loadu_si512(packed + 64 * i), zero_point));
    return staging;
  } else {
    return q + s0 * kSub * 16;
  }
}

// The integer sums of sub-blocks [s0, s1) for the configured tokens (A rows) from x_quants (a row per token,
// `columns` apart) by the B rows at b (kSub * 16 bytes a sub-block), into products[s - s0][token][row]; prefetching
// the lines `ahead` bytes past the weight's (at `weight`, the same layout in packed bytes) where ahead != 0.
template <int kSub, bool kSigned>
inline void tile_products(const int8_t* x_quants, int64_t columns, const uint8_t* b, int64_t s0, int64_t s1,
                          const uint8_t* weight, int64_t weight_sub_bytes, int64_t ahead, int32_t* products) {
  constexpr int64_t kBBytes = kSub * 16;
  const auto prefetch = [&](int64_t s) __attribute__((always_inline)) {  // into L2: 0.92x the time of into L1
    if (ahead == 0) return;
    for (int64_t line = 0; line < weight_sub_bytes; line += 64)
      __builtin_prefetch(weight + s * weight_sub_bytes + line + ahead, 0, 2);
  };
  // tile c += tile a's signed bytes by tile b's signed (kSigned) or unsigned ones; a macro, not a function: the
  // intrinsics take their tiles' numbers as literals, spelled into the instruction
#define AMX_PRODUCT(c, a, b)                        \
  do {                                              \
    if constexpr (kSigned) _tile_dpbssd(c, a, b);   \
    else _tile_dpbsud(c, a, b);                     \
  } while (0)
  int64_t s = s0;
  for (; s + 2 <= s1; s += 2) {
    const int64_t i = s - s0;
    prefetch(i);
    prefetch(i + 1);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, x_quants + s * kSub, columns);
    _tile_loadd(4, b + i * kBBytes, 64);
    _tile_loadd(3, x_quants + (s + 1) * kSub, columns);
    _tile_loadd(5, b + (i + 1) * kBBytes, 64);
    AMX_PRODUCT(0, 2, 4);
    AMX_PRODUCT(1, 3, 5);
    _tile_stored(0, products + i * kProductsPerSub, 64);
    _tile_stored(1, products + (i + 1) * kProductsPerSub, 64);
  }
  if (s < s1) {
    prefetch(s - s0);
    _tile_zero(0);
    _tile_loadd(2, x_quants + s * kSub, columns);
    _tile_loadd(4, b + (s - s0) * kBBytes, 64);
    AMX_PRODUCT(0, 2, 4);
    _tile_stored(0, products + (s - s0) * kProductsPerSub, 64);
  }
#undef AMX_PRODUCT
}

// out[t0 + t, 0 .. rows) for MT tokens from products row `first` on, over sub-blocks [s0, s1): per sub-block and
// token, acc += float(S) * (d * scale) (+ m * scale * sum(q) for the formats with a min), MT accumulators of the
// tile's 16 rows in registers.
template <int MT, int kSub, bool kMin>
inline void scale_products(const int32_t* products, int first, const float* d, const float* m, int64_t s0, int64_t s1,
                           bool accumulate, const Int8Activations& x, int64_t t0, int64_t columns, float* out,
                           int64_t ldo, int64_t rows) {
  const int64_t xblocks = columns / kActivationBlock, sums_per_token = columns / kSub;
  const __mmask16 mask = (__mmask16)((1u << rows) - 1);
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t)
    acc[t] = accumulate ? _mm512_maskz_loadu_ps(mask, out + (t0 + t) * ldo) : _mm512_setzero_ps();
  const float* scales = x.scales + t0 * xblocks;
  const float* scaled_sums = (kSub == 32 ? x.scaled_sums32 : x.scaled_sums16) + t0 * sums_per_token;
  for (int64_t s = s0; s < s1; ++s) {
    const __m512 ds = _mm512_loadu_ps(d + s * kTileRows);
    const int32_t* sums = products + (s - s0) * kProductsPerSub + first * kTileRows;
    const int64_t xb = s * kSub / kActivationBlock;
    for (int t = 0; t < MT; ++t)
      acc[t] = int8_add_scaled_sums<kMin>(acc[t], _mm512_loadu_si512(sums + t * kTileRows), ds,
                                          scales[t * xblocks + xb], kMin ? m + s * kTileRows : nullptr,
                                          kMin ? scaled_sums[t * sums_per_token + s] : 0.0f);
  }
  for (int t = 0; t < MT; ++t) _mm512_mask_storeu_ps(out + (t0 + t) * ldo, mask, acc[t]);
}

template <int kLargest, int kSub, bool kMin>
void amx_tiles(const Int8Activations& x, const uint8_t* quants, const float* scales, const float* mins, float offset,
               int64_t columns, int64_t first_tile, int64_t last_tile, int64_t rows, float* out) {
  constexpr bool kSigned = !kMin;
  const int64_t subs = columns / kSub, tile_bytes = kTileRows * columns * int8_bits_of(kLargest) / 8;
  const int64_t chunk = kChunkColumns / kSub, weight_sub_bytes = kTileRows * kSub * int8_bits_of(kLargest) / 8;
  alignas(64) int32_t products[kMaxChunkSubs * kProductsPerSub];
  alignas(64) uint8_t staging[kTileRows * kChunkColumns];
  // The whole groups of 16 tokens under one configuration, the rest (or a step of fewer) under another.
  const int64_t whole = x.tokens / kGroupTokens * kGroupTokens;
  for (int part = 0; part < 2; ++part) {
    const int64_t begin = part == 0 ? 0 : whole, end = part == 0 ? whole : x.tokens;
    const int64_t group = part == 0 ? kGroupTokens : end - begin;
    if (begin == end) continue;
    configure((int)group, kSub);
    // the first part run streams the weights from memory; it prefetches in steps of few tokens
    const bool prefetching = x.tokens <= kPrefetchTokens && (part == 0 || whole == 0);
    for (int64_t tile = first_tile; tile < last_tile; ++tile) {
      const uint8_t* q = quants + tile * tile_bytes;
      const float* d = scales + tile * subs * kTileRows;
      const float* m = kMin ? mins + tile * subs * kTileRows : nullptr;
      const int64_t n0 = tile * kTileRows, tile_rows = rows - n0 < kTileRows ? rows - n0 : kTileRows;
      const int64_t ahead = prefetching && tile + 2 < last_tile ? 2 * tile_bytes : 0;
      for (int64_t s0 = 0; s0 < subs; s0 += chunk) {
        const int64_t s1 = s0 + chunk < subs ? s0 + chunk : subs;
        const uint8_t* b = b_rows<kLargest, kSub, kSigned>(q, s0, s1, offset, staging);
        for (int64_t t0 = begin; t0 < end; t0 += group) {
          tile_products<kSub, kSigned>(x.quants + t0 * columns, columns, b, s0, s1, q + s0 * weight_sub_bytes,
                                       weight_sub_bytes, t0 == begin ? ahead : 0, products);
          // the group's tokens 16, 8, 4, 2, 1 at a time, as many accumulators as registers hold
          int first = 0;
          const auto pass = [&](auto tokens) __attribute__((always_inline)) {
            scale_products<decltype(tokens)::value, kSub, kMin>(products, first, d, m, s0, s1, s0 > 0, x, t0 + first,
                                                                columns, out + n0, rows, tile_rows);
            first += decltype(tokens)::value;
          };
          if (group == 16) pass(std::integral_constant<int, 16>{});
          if (group - first >= 8) pass(std::integral_constant<int, 8>{});
          if (group - first >= 4) pass(std::integral_constant<int, 4>{});
          if (group - first >= 2) pass(std::integral_constant<int, 2>{});
          if (group - first >= 1) pass(std::integral_constant<int, 1>{});
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

void matmul_tiles(const Format& format, const Int8Activations& x, const uint8_t* quants, const float* scales,
                  const float* mins, int64_t columns, int64_t first_tile, int64_t last_tile, int64_t rows, float* out) {
  if (x.tokens < kAmxFromTokens) {
    isa_avx512_vnni::int8_kernels.matmul_tiles(format, x, quants, scales, mins, columns, first_tile, last_tile, rows,
                                               out);
    return;
  }
  const float offset = (float)int8_offset(format.kind);
  const auto run = [&](auto tiles) {
    tiles(x, quants, scales, mins, offset, columns, first_tile, last_tile, rows, out);
  };
  const bool has_min = int8_has_min(format.kind);
  switch (int8_largest_quant(format.kind)) {
    case 15: has_min ? run(amx_tiles<15, 32, true>) : run(amx_tiles<15, 32, false>); break;
    case 31: has_min ? run(amx_tiles<31, 32, true>) : run(amx_tiles<31, 32, false>); break;
    case 63: run(amx_tiles<63, 16, false>); break;  // Q6_K
    default: run(amx_tiles<255, 32, false>); break;  // Q8_0, int8
  }
}

}  // namespace quantized_matmul::isa_amx_int8
#pragma GCC pop_options
#endif
