// Matmuls of quantized weights that dequantize on the fly (GGUF blocks, weight-only int8 / int4 groups, AWQ / GPTQ
// 4-bit groups with zero points): the Python module, its checks and threads.
// The body (quantized_matmul_body.h) is compiled three times, each in its own file so that ninja builds them in
// parallel: for AVX-512 (quantized_matmul_avx512.cpp), for AVX2 + FMA (_avx2.cpp), and portable (_portable.cpp);
// the instruction set is chosen at run time from what the CPU reports (or forced by the caller, which is how the
// tests run every path on one machine). Built without -march=native so the one build runs on any x86-64.
// pybind11 and its Tensor conversions only: torch/extension.h adds the whole C++ frontend (torch/all.h), which
// nothing here uses and which took two thirds of this file's compile time.
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "isa_dispatch.h"
#include "quantized_matmul.h"

namespace {

using quantized_matmul::Format;
using quantized_matmul::Kind;
using quantized_matmul::RowKernels;
using quantized_matmul::kTileRows;

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

using isa_dispatch::Isa;
using isa_dispatch::best_isa;
using isa_dispatch::isa_name;
using isa_dispatch::parse_isa;

void check_weight(const at::Tensor& weight, const Format& format, int64_t columns) {
  TORCH_CHECK(weight.dtype() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "quantized weight must be a contiguous uint8 [rows, row_bytes] tensor");
  TORCH_CHECK(columns % format.block_values == 0, "columns (", columns, ") must be a multiple of the block size (",
              format.block_values, ")");
  TORCH_CHECK(weight.size(1) == columns / format.block_values * format.block_bytes, "row of ", weight.size(1),
              " bytes does not hold ", columns, " values of this format");
}

// The chosen instruction set's build of the body.
const RowKernels& row_kernels(Isa isa) {
  switch (isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    case Isa::Avx512: return quantized_matmul::isa_avx512::row_kernels;
    case Isa::Avx2: return quantized_matmul::isa_avx2::row_kernels;
#endif
    default: return quantized_matmul::isa_portable::row_kernels;
  }
}

}  // namespace

// float32 [rows, columns] values of the quantized rows.
at::Tensor dequantize(const at::Tensor& weight, int64_t kind, int64_t group, int64_t columns, const std::string& isa_choice) {
  const Format format = format_of(kind, group);
  check_weight(weight, format, columns);
  const RowKernels& kernels = row_kernels(parse_isa(isa_choice));
  const int64_t rows = weight.size(0), row_bytes = weight.size(1);
  auto out = at::empty({rows, columns}, at::kFloat);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    kernels.dequantize_rows(format, w, row_bytes, columns, begin, end, y);
  });
  return out;
}

// x [tokens, columns] float32 times the dequantized weight [rows, columns] transposed: [tokens, rows] float32.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight, int64_t kind, int64_t group, const std::string& isa_choice) {
  const Format format = format_of(kind, group);
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x must be contiguous float32 [tokens, columns]");
  const int64_t tokens = x.size(0), columns = x.size(1), rows = weight.size(0), row_bytes = weight.size(1);
  check_weight(weight, format, columns);
  const RowKernels& kernels = row_kernels(parse_isa(isa_choice));
  auto out = at::empty({tokens, rows}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  // Whole tiles per task, so threads never share a tile.
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scratch(kTileRows * columns);
    const int64_t begin = first * kTileRows, end = std::min(rows, last * kTileRows);
    kernels.matmul_rows(format, xp, tokens, w, row_bytes, columns, begin, end, o, rows, scratch.data());
  });
  return out;
}

std::string best_isa_name() { return isa_name(best_isa()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize", &dequantize, "float32 values of quantized rows");
  m.def("matmul", &matmul, "x @ dequantize(weight).T, dequantizing a tile of rows at a time");
  m.def("best_isa", &best_isa_name, "the widest instruction set this CPU runs: avx512, avx2 or portable");
}
