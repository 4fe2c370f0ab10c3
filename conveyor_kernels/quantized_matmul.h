// What the quantized matmul's translation units share: the weight formats, the exact half -> float conversion, the
// tile height, and the row kernels each instruction-set build exports. quantized_matmul.cpp (the Python module:
// checks, threads, the run-time choice of path) calls them through `RowKernels`; quantized_matmul_avx512.cpp,
// _avx2.cpp and _portable.cpp each compile quantized_matmul_body.h for their instruction set, and
// quantized_matmul_avx512_bf16.cpp the bf16 path, so that ninja builds the four in parallel. No torch header here: the bodies need none, and parsing one costs each file seconds.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace quantized_matmul {

// ggml's type ids, the two weight-only group formats, and the asymmetric 4-bit groups of AWQ / GPTQ checkpoints
// (ids of our own, outside ggml's range).
enum class Kind : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, INT8 = 1008, INT4 = 1004,
  UINT4_ZP = 1005,
};

struct Format {
  Kind kind;
  int block_values;  // values per block (the group size for INT8 / INT4)
  int block_bytes;
};

// IEEE half to float, exactly (subnormal halves become normal floats). Always inlined, so each instruction-set
// body compiles it in its own encoding: called out of line from the AVX-512 / AVX2 bodies, its legacy-SSE
// instructions ran after wide vector code with the upper register halves dirty, an SSE/AVX transition per block
// that made those paths up to 15x slower than the portable one on Q8_0 (measured on a Xeon with AMX).
__attribute__((always_inline)) inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0) {
    const float magnitude = (float)mantissa * (1.0f / 16777216.0f);  // mantissa * 2^-24
    return sign ? -magnitude : magnitude;
  }
  bits = exponent == 31 ? (sign | 0x7F800000u | (mantissa << 13)) : (sign | ((exponent + 112) << 23) | (mantissa << 13));
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4).
__attribute__((always_inline)) inline void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

constexpr int64_t kTileRows = 16;  // weight rows dequantized at a time: 16 x 4 KiB columns fit L2

// One instruction set's row kernels (quantized_matmul_body.h): float32 values of weight rows [begin, end), and
// out[:, begin:end] = x @ dequantize(weight[begin:end]).T a tile of kTileRows rows at a time through `scratch`
// (kTileRows * columns floats).
struct RowKernels {
  void (*dequantize_rows)(const Format& format, const uint8_t* weight, int64_t row_bytes, int64_t columns,
                          int64_t begin, int64_t end, float* out);
  void (*matmul_rows)(const Format& format, const float* x, int64_t tokens, const uint8_t* weight, int64_t row_bytes,
                      int64_t columns, int64_t begin, int64_t end, float* out, int64_t out_columns, float* scratch);
};

// int8 activations (quantized_matmul_int8.h): a step's tokens quantized per block of kActivationBlock values to
// int8 quants with a float32 scale; and the sums of each 16 and 32 quants, as they are and times their block's scale.
constexpr int64_t kActivationBlock = 32;
// Steps of up to this many tokens prefetch a tile's weights two tiles ahead (the int8 bodies' int8_prefetch, the AMX
// tiles): above it a tile takes so many passes that the lines would wait long in L1 beside the activations.
constexpr int64_t kPrefetchTokens = 32;

struct Int8Activations {
  const int8_t* quants;         // [tokens, columns]
  const float* scales;          // [tokens, columns / 32]
  const float* scaled_sums16;   // [tokens, columns / 16]: scale * sum of each 16 quants
  const float* scaled_sums32;   // [tokens, columns / 32]: scale * sum of each 32
  const int32_t* sums16;        // [tokens, columns / 16]: the sums themselves
  const int32_t* sums32;        // [tokens, columns / 32]
  int64_t tokens;
};

// A weight repacked for the int8 dot products (quantized_matmul_int8.h's layout): per tile of kTileRows rows,
// its unsigned quants u, then per sub-block the tile's scales d and, for the formats with a min or a zero point per
// group, offsets m (float32, kTileRows each); a value is d * (u - int8_offset(kind)) + m.
inline int int8_sub_block(Kind kind) { return kind == Kind::Q6_K ? 16 : 32; }  // values per (d, m)
inline bool int8_has_min(Kind kind) {
  return kind == Kind::Q4_1 || kind == Kind::Q5_1 || kind == Kind::Q4_K || kind == Kind::Q5_K || kind == Kind::UINT4_ZP;
}
inline int int8_offset(Kind kind) {  // the other formats' zero point, the same for every block
  switch (kind) {
    case Kind::Q4_0: case Kind::INT4: return 8;
    case Kind::Q5_0: return 16;
    case Kind::Q6_K: return 32;
    case Kind::Q8_0: case Kind::INT8: return 128;
    default: return 0;
  }
}
inline int int8_largest_quant(Kind kind) {  // the largest u: 2^bits - 1
  switch (kind) {
    case Kind::Q4_0: case Kind::Q4_1: case Kind::Q4_K: case Kind::INT4: case Kind::UINT4_ZP: return 15;
    case Kind::Q5_0: case Kind::Q5_1: case Kind::Q5_K: return 31;
    case Kind::Q6_K: return 63;
    default: return 255;  // Q8_0, int8
  }
}
// Bits a quant takes in the repacked tile: 4 (two a byte) for the 4-bit formats, else 8 (the 5- and 6-bit too).
constexpr int int8_bits_of(int largest_quant) { return largest_quant <= 15 ? 4 : 8; }
inline int int8_bits(Kind kind) { return int8_bits_of(int8_largest_quant(kind)); }

// One instruction set's int8-activation kernels (quantized_matmul_int8.h). quantize_activations: x [tokens,
// columns] (float32, or bf16 bits where x16 is given instead) as above. pack_tile: weight rows [0, rows) (rows <=
// kTileRows; the rest zeros) into one tile's quants, scales and (int8_has_min) offsets m. matmul_tiles: out[:, 16 * first_tile ..) =
// x @ dequantize(tiles [first_tile, last_tile)).T, up to `rows` output rows.
struct Int8Kernels {
  void (*quantize_activations)(const float* x32, const uint16_t* x16, int64_t tokens, int64_t columns,
                               int8_t* quants, float* scales, float* scaled_sums16, float* scaled_sums32,
                               int32_t* sums16, int32_t* sums32);
  void (*pack_tile)(const Format& format, const uint8_t* weight, int64_t row_bytes, int64_t columns, int64_t rows,
                    uint8_t* quants, float* scales, float* mins);
  void (*matmul_tiles)(const Format& format, const Int8Activations& x, const uint8_t* quants, const float* scales,
                       const float* mins, int64_t columns, int64_t first_tile, int64_t last_tile, int64_t rows,
                       float* out);
};

#if defined(__x86_64__) && defined(__GNUC__)
namespace isa_avx512 { extern const RowKernels row_kernels; }  // quantized_matmul_avx512.cpp
namespace isa_avx2 { extern const RowKernels row_kernels; }  // quantized_matmul_avx2.cpp
namespace isa_avx2 { extern const Int8Kernels int8_kernels; }
namespace isa_avx512_vnni { extern const Int8Kernels int8_kernels; }  // quantized_matmul_avx512_vnni.cpp
// quantized_matmul_amx.cpp: Int8Kernels' matmul_tiles on AMX tiles, for VNNI's activations and repack.
namespace isa_amx_int8 {
void matmul_tiles(const Format& format, const Int8Activations& x, const uint8_t* quants, const float* scales,
                  const float* mins, int64_t columns, int64_t first_tile, int64_t last_tile, int64_t rows, float* out);
}
// quantized_matmul_avx512_bf16.cpp (quantized_matmul_bf16.h): out[:, begin:end] = x @ bf16(dequantize(weight)).T for
// bf16 x (its bits), through `row` (columns floats) and `tile` (kTileRows * columns bf16 bits); CPUs with AVX-512 BF16.
namespace isa_avx512_bf16 {
void matmul_rows_bf16(const Format& format, const uint16_t* x, int64_t tokens, const uint8_t* weight,
                      int64_t row_bytes, int64_t columns, int64_t begin, int64_t end, float* out, int64_t out_columns,
                      float* row, uint16_t* tile);
}
#endif
namespace isa_portable { extern const RowKernels row_kernels; }  // quantized_matmul_portable.cpp
namespace isa_portable { extern const Int8Kernels int8_kernels; }

}  // namespace quantized_matmul
