// What the quantized matmul's translation units share: the weight formats, the exact half -> float conversion, the
// tile height, and the row kernels each instruction-set build exports. quantized_matmul.cpp (the Python module:
// checks, threads, the run-time choice of path) calls them through `RowKernels`; quantized_matmul_avx512.cpp,
// _avx2.cpp and _portable.cpp each compile quantized_matmul_body.h for their instruction set, and
// quantized_matmul_avx512_bf16.cpp the bf16 path, so that ninja builds the four in parallel. No torch header here: the bodies need none, and parsing one costs each file seconds.
#pragma once
#include <cstdint>
#include <cstring>

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

#if defined(__x86_64__) && defined(__GNUC__)
namespace isa_avx512 { extern const RowKernels row_kernels; }  // quantized_matmul_avx512.cpp
namespace isa_avx2 { extern const RowKernels row_kernels; }  // quantized_matmul_avx2.cpp
// quantized_matmul_avx512_bf16.cpp (quantized_matmul_bf16.h): out[:, begin:end] = x @ bf16(dequantize(weight)).T for
// bf16 x (its bits), through `row` (columns floats) and `tile` (kTileRows * columns bf16 bits); CPUs with AVX-512 BF16.
namespace isa_avx512_bf16 {
void matmul_rows_bf16(const Format& format, const uint16_t* x, int64_t tokens, const uint8_t* weight,
                      int64_t row_bytes, int64_t columns, int64_t begin, int64_t end, float* out, int64_t out_columns,
                      float* row, uint16_t* tile);
}
#endif
namespace isa_portable { extern const RowKernels row_kernels; }  // quantized_matmul_portable.cpp

}  // namespace quantized_matmul
