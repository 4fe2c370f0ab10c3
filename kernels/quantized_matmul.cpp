// Matmuls of quantized weights that dequantize on the fly (GGUF blocks, weight-only int8 / int4 groups, AWQ / GPTQ
// 4-bit groups with zero points).
// The body (quantized_matmul_body.h) is compiled three times: for AVX-512, for AVX2 + FMA, and portable; the
// instruction set is chosen at run time from what the CPU reports (or forced by the caller, which is how the
// tests run every path on one machine). Built without -march=native so the one build runs on any x86-64.
// bf16 x has a fourth path, quantized_matmul_bf16.h (AVX-512 BF16: the tile rounded to bf16, bf16 dot products),
// taken where the CPU has AVX-512 BF16; elsewhere bf16 x is converted to float32 and takes the float32 paths.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "isa_dispatch.h"

namespace {

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

Format format_of(int64_t kind, int64_t group) {
  switch (static_cast<Kind>(kind)) {
    case Kind::Q4_0: return {Kind::Q4_0, 32, 18};
    case Kind::Q4_1: return {Kind::Q4_1, 32, 20};
    case Kind::Q5_0: return {Kind::Q5_0, 32, 22};
    case Kind::Q5_1: return {Kind::Q5_1, 32, 24};
    case Kind::Q8_0: return {Kind::Q8_0, 32, 34};
    case Kind::Q4_K: return {Kind::Q4_K, 256, 144};
    case Kind::Q5_K: return {Kind::Q5_K, 256, 176};
    case Kind::Q6_K: return {Kind::Q6_K, 256, 210};
    case Kind::INT8: return {Kind::INT8, (int)group, 4 + (int)group};
    case Kind::INT4: return {Kind::INT4, (int)group, 4 + (int)group / 2};
    case Kind::UINT4_ZP: return {Kind::UINT4_ZP, (int)group, 5 + (int)group / 2};
  }
  TORCH_CHECK(false, "quantized matmul: unknown weight format id ", kind);
}

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

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")
namespace isa_avx512 {
#define VEC_FLOATS 16
#include "quantized_matmul_body.h"
#undef VEC_FLOATS
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")
#include "avx512_math.h"  // sum_lanes_16
namespace isa_avx512_bf16 {
#include "quantized_matmul_bf16.h"
}  // namespace isa_avx512_bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace isa_avx2 {
#define VEC_FLOATS 8
#include "quantized_matmul_body.h"
#undef VEC_FLOATS
}  // namespace isa_avx2
#pragma GCC pop_options
#endif

namespace isa_portable {
#define VEC_FLOATS 4
#include "quantized_matmul_body.h"
#undef VEC_FLOATS
}  // namespace isa_portable

namespace {

using isa_dispatch::Isa;
using isa_dispatch::best_isa;
using isa_dispatch::has_avx512_bf16;
using isa_dispatch::isa_name;
using isa_dispatch::parse_isa;

void check_weight(const torch::Tensor& weight, const Format& format, int64_t columns) {
  TORCH_CHECK(weight.dtype() == torch::kUInt8 && weight.dim() == 2 && weight.is_contiguous(),
              "quantized weight must be a contiguous uint8 [rows, row_bytes] tensor");
  TORCH_CHECK(columns % format.block_values == 0, "columns (", columns, ") must be a multiple of the block size (",
              format.block_values, ")");
  TORCH_CHECK(weight.size(1) == columns / format.block_values * format.block_bytes, "row of ", weight.size(1),
              " bytes does not hold ", columns, " values of this format");
}

// Whether a matmul of x takes the bf16 path: asked for by name ("avx512_bf16"), or "auto" with bf16 x on a CPU that
// runs it. Asked for float32 x (whose runs keep the float32 weights) or on a CPU without AVX-512 BF16: refused.
bool takes_bf16_path(const torch::Tensor& x, const std::string& isa_choice) {
  if (isa_choice == "auto") return x.dtype() == torch::kBFloat16 && has_avx512_bf16();
  if (isa_choice != "avx512_bf16") return false;
  TORCH_CHECK(x.dtype() == torch::kBFloat16, "the avx512_bf16 path multiplies bf16 x; float32 x takes the float32 "
              "paths (auto, avx512, avx2, portable)");
  TORCH_CHECK(has_avx512_bf16(), "this CPU cannot run the avx512_bf16 path (no AVX-512 BF16; best: ",
              isa_name(best_isa()), ")");
  return true;
}

// fn(begin, end) over the rows in whole tiles, in parallel: threads never share a tile.
template <typename Fn>
void over_tiles(int64_t rows, const Fn& fn) {
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    fn(first * kTileRows, std::min(rows, last * kTileRows));
  });
}

}  // namespace

// float32 [rows, columns] values of the quantized rows.
torch::Tensor dequantize(const torch::Tensor& weight, int64_t kind, int64_t group, int64_t columns, const std::string& isa_choice) {
  const Format format = format_of(kind, group);
  check_weight(weight, format, columns);
  const Isa isa = parse_isa(isa_choice);
  const int64_t rows = weight.size(0), row_bytes = weight.size(1);
  auto out = torch::empty({rows, columns}, torch::kFloat32);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    switch (isa) {
#if defined(__x86_64__) && defined(__GNUC__)
      case Isa::Avx512: isa_avx512::dequantize_rows(format, w, row_bytes, columns, begin, end, y); break;
      case Isa::Avx2: isa_avx2::dequantize_rows(format, w, row_bytes, columns, begin, end, y); break;
#endif
      default: isa_portable::dequantize_rows(format, w, row_bytes, columns, begin, end, y);
    }
  });
  return out;
}

// x [tokens, columns] float32 or bf16 times the dequantized weight [rows, columns] transposed: [tokens, rows]
// float32. bf16 x on the avx512_bf16 path multiplies the weights rounded to bf16; on the float32 paths (which bf16 x
// takes where the CPU lacks AVX-512 BF16, or when one is asked for) it is converted to float32 and multiplies the
// float32 weights.
torch::Tensor matmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t kind, int64_t group, const std::string& isa_choice) {
  const Format format = format_of(kind, group);
  TORCH_CHECK((x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous float32 or bf16 [tokens, columns]");
  const int64_t tokens = x.size(0), columns = x.size(1), rows = weight.size(0), row_bytes = weight.size(1);
  check_weight(weight, format, columns);
  auto out = torch::empty({tokens, rows}, torch::kFloat32);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  if (takes_bf16_path(x, isa_choice)) {  // never true where the path is not compiled
#if defined(__x86_64__) && defined(__GNUC__)
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    over_tiles(rows, [&](int64_t begin, int64_t end) {
      std::vector<float> row(columns);
      std::vector<uint16_t> tile(kTileRows * columns);
      isa_avx512_bf16::matmul_rows(format, xp, tokens, w, row_bytes, columns, begin, end, o, rows, row.data(), tile.data());
    });
    return out;
#endif
  }
  const Isa isa = parse_isa(isa_choice);
  const torch::Tensor x32 = x.to(torch::kFloat32);  // bf16 x: its values exactly
  const float* xp = x32.data_ptr<float>();
  over_tiles(rows, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kTileRows * columns);
    switch (isa) {
#if defined(__x86_64__) && defined(__GNUC__)
      case Isa::Avx512:
        isa_avx512::matmul_rows(format, xp, tokens, w, row_bytes, columns, begin, end, o, rows, scratch.data());
        break;
      case Isa::Avx2:
        isa_avx2::matmul_rows(format, xp, tokens, w, row_bytes, columns, begin, end, o, rows, scratch.data());
        break;
#endif
      default: isa_portable::matmul_rows(format, xp, tokens, w, row_bytes, columns, begin, end, o, rows, scratch.data());
    }
  });
  return out;
}

std::string best_isa_name() { return isa_name(best_isa()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize", &dequantize, "float32 values of quantized rows");
  m.def("matmul", &matmul, "x @ dequantize(weight).T, dequantizing a tile of rows at a time");
  m.def("best_isa", &best_isa_name, "the widest instruction set this CPU runs: avx512, avx2 or portable");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether this CPU runs the avx512_bf16 path (bf16 x)");
}
