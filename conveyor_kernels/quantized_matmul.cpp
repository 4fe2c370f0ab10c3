// Matmuls of quantized weights that dequantize on the fly (GGUF blocks, weight-only int8 / int4 groups, AWQ / GPTQ
// 4-bit groups with zero points): the Python module, its checks and threads.
// The body (quantized_matmul_body.h) is compiled three times, each in its own file so that ninja builds them in
// parallel: for AVX-512 (quantized_matmul_avx512.cpp), for AVX2 + FMA (_avx2.cpp), and portable (_portable.cpp);
// the instruction set is chosen at run time from what the CPU reports (or forced by the caller, which is how the
// tests run every path on one machine). Built without -march=native so the one build runs on any x86-64.
// bf16 x has a fourth path, quantized_matmul_bf16.h (AVX-512 BF16: the tile rounded to bf16, bf16 dot products, in
// quantized_matmul_avx512_bf16.cpp), taken where the CPU has AVX-512 BF16; elsewhere bf16 x is converted to float32
// and takes the float32 paths.
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
using isa_dispatch::has_amx_int8;
using isa_dispatch::has_avx512_bf16;
using isa_dispatch::has_avx512_vnni;
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

// The int8-activation kernels of a path: "amx_int8" (tdpbsud on AMX tiles, with VNNI's quantization and repack),
// "avx512_vnni" (vpdpbusd), "avx2" (vpmaddubsw; also what an AVX-512 CPU without VNNI runs: faster there than a
// plain body compiled for AVX-512) or "portable"; "auto" the best this CPU runs. A path this CPU cannot run, or
// "avx512" (no such int8 path), is refused.
const quantized_matmul::Int8Kernels& int8_kernels(const std::string& isa_choice) {
  TORCH_CHECK(isa_choice != "avx512" && isa_choice != "avx512_bf16",
              "int8 activations' paths are auto, amx_int8, avx512_vnni, avx2 and portable; got ", isa_choice);
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa_choice == "amx_int8" || (isa_choice == "auto" && has_amx_int8())) {
    TORCH_CHECK(has_amx_int8(), "this CPU cannot run the amx_int8 path (no AMX-INT8, or the kernel lends no AMX "
                "tiles to this process; best: ", isa_name(best_isa()), ")");
    static const quantized_matmul::Int8Kernels amx = {
        quantized_matmul::isa_avx512_vnni::int8_kernels.quantize_activations,
        quantized_matmul::isa_avx512_vnni::int8_kernels.pack_tile, &quantized_matmul::isa_amx_int8::matmul_tiles};
    return amx;
  }
  if (isa_choice == "avx512_vnni" || (isa_choice == "auto" && has_avx512_vnni())) {
    TORCH_CHECK(has_avx512_vnni(), "this CPU cannot run the avx512_vnni path (no AVX-512 VNNI; best: ",
                isa_name(best_isa()), ")");
    return quantized_matmul::isa_avx512_vnni::int8_kernels;
  }
  if (parse_isa(isa_choice) != Isa::Portable) return quantized_matmul::isa_avx2::int8_kernels;
#else
  TORCH_CHECK(isa_choice != "avx512_vnni" && isa_choice != "amx_int8", "the ", isa_choice, " path is x86-64 only");
  parse_isa(isa_choice);
#endif
  return quantized_matmul::isa_portable::int8_kernels;
}

// Whether a matmul of x takes the bf16 path: asked for by name ("avx512_bf16"), or "auto" with bf16 x on a CPU that
// runs it. Asked for float32 x (whose runs keep the float32 weights) or on a CPU without AVX-512 BF16: refused.
bool takes_bf16_path(const at::Tensor& x, const std::string& isa_choice) {
  if (isa_choice == "auto") return x.dtype() == at::kBFloat16 && has_avx512_bf16();
  if (isa_choice != "avx512_bf16") return false;
  TORCH_CHECK(x.dtype() == at::kBFloat16, "the avx512_bf16 path multiplies bf16 x; float32 x takes the float32 "
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

// x [tokens, columns] float32 or bf16 times the dequantized weight [rows, columns] transposed: [tokens, rows]
// float32. bf16 x on the avx512_bf16 path multiplies the weights rounded to bf16; on the float32 paths (which bf16 x
// takes where the CPU lacks AVX-512 BF16, or when one is asked for) it is converted to float32 and multiplies the
// float32 weights.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight, int64_t kind, int64_t group, const std::string& isa_choice) {
  const Format format = format_of(kind, group);
  TORCH_CHECK((x.dtype() == at::kFloat || x.dtype() == at::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous float32 or bf16 [tokens, columns]");
  const int64_t tokens = x.size(0), columns = x.size(1), rows = weight.size(0), row_bytes = weight.size(1);
  check_weight(weight, format, columns);
  auto out = at::empty({tokens, rows}, at::kFloat);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  if (takes_bf16_path(x, isa_choice)) {  // never true where the path is not compiled
#if defined(__x86_64__) && defined(__GNUC__)
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    over_tiles(rows, [&](int64_t begin, int64_t end) {
      std::vector<float> row(columns);
      std::vector<uint16_t> tile(kTileRows * columns);
      quantized_matmul::isa_avx512_bf16::matmul_rows_bf16(format, xp, tokens, w, row_bytes, columns, begin, end, o,
                                                          rows, row.data(), tile.data());
    });
    return out;
#endif
  }
  const RowKernels& kernels = row_kernels(parse_isa(isa_choice));
  const at::Tensor x32 = x.to(at::kFloat);  // bf16 x: its values exactly
  const float* xp = x32.data_ptr<float>();
  over_tiles(rows, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kTileRows * columns);
    kernels.matmul_rows(format, xp, tokens, w, row_bytes, columns, begin, end, o, rows, scratch.data());
  });
  return out;
}

// A quantized weight [rows, row_bytes] repacked for the int8-activation kernels (quantized_matmul_int8.h): uint8
// quants [tiles, tile bytes], float32 scales [tiles, sub-blocks, kTileRows] and offsets (mins) likewise, [0] for the
// formats whose zero point is the same in every block (int8_has_min). Once, at load.
std::vector<at::Tensor> pack_int8(const at::Tensor& weight, int64_t kind, int64_t group, int64_t columns) {
  const Format format = format_of(kind, group);
  check_weight(weight, format, columns);
  const int sub = quantized_matmul::int8_sub_block(format.kind);
  TORCH_CHECK(format.block_values % sub == 0 && columns % quantized_matmul::kActivationBlock == 0,
              "int8 activations need groups of a multiple of 32 input features; this weight's groups are ",
              format.block_values);
  const int64_t rows = weight.size(0), row_bytes = weight.size(1), tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t subs = columns / sub, tile_bytes = kTileRows * columns * quantized_matmul::int8_bits(format.kind) / 8;
  auto quants = at::empty({tiles, tile_bytes}, at::kByte);
  auto scales = at::empty({tiles, subs, kTileRows}, at::kFloat);
  const bool has_min = quantized_matmul::int8_has_min(format.kind);
  auto mins = has_min ? at::empty({tiles, subs, kTileRows}, at::kFloat) : at::empty({0}, at::kFloat);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t n0 = tile * kTileRows;
      quantized_matmul::isa_portable::int8_kernels.pack_tile(
          format, w + n0 * row_bytes, row_bytes, columns, std::min(kTileRows, rows - n0),
          quants.data_ptr<uint8_t>() + tile * tile_bytes, scales.data_ptr<float>() + tile * subs * kTileRows,
          has_min ? mins.data_ptr<float>() + tile * subs * kTileRows : nullptr);
    }
  });
  return {quants, scales, mins};
}

// Rows `ids` of a weight packed by pack_int8, as float32 [ids, columns]: d * (u - offset) + m, the dequantized values
// exactly (quantized_matmul_int8.h), so that a tied embedding can look its rows up in the output projection's repack
// instead of holding the blocks a second time. Two roundings, as gguf-py's: this file is built for baseline x86-64,
// which has no fused multiply-add to contract them into.
at::Tensor int8_rows(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins, int64_t kind,
                     int64_t group, int64_t columns, const at::Tensor& ids) {
  const Format format = format_of(kind, group);
  const int sub = quantized_matmul::int8_sub_block(format.kind), bits = quantized_matmul::int8_bits(format.kind);
  const int64_t subs = columns / sub, tile_bytes = kTileRows * columns * bits / 8;
  const bool has_min = quantized_matmul::int8_has_min(format.kind);
  TORCH_CHECK(ids.dtype() == at::kLong && ids.dim() == 1 && quants.dim() == 2 && quants.size(1) == tile_bytes &&
              scales.numel() == quants.size(0) * subs * kTileRows && mins.numel() == (has_min ? scales.numel() : 0),
              "ids must be int64 [n] and the packed weight match the columns and the format (pack it with pack_int8)");
  const auto quant = quants.contiguous(), scale = scales.contiguous(), min = mins.contiguous();
  const auto id = ids.contiguous();
  const int64_t n = id.size(0), tiles = quant.size(0);
  const float offset = (float)quantized_matmul::int8_offset(format.kind);
  auto out = at::empty({n, columns}, at::kFloat);
  const int64_t* row_ids = id.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < tiles * kTileRows, "row id ", row_ids[i], " is outside the weight");
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t tile = row_ids[i] / kTileRows, r = row_ids[i] % kTileRows;
      const uint8_t* q = quant.data_ptr<uint8_t>() + tile * tile_bytes;
      const float* d = scale.data_ptr<float>() + tile * subs * kTileRows + r;
      const float* m = has_min ? min.data_ptr<float>() + tile * subs * kTileRows + r : nullptr;
      float* o = out.data_ptr<float>() + i * columns;
      for (int64_t k = 0; k < columns; ++k) {
        // 8-bit: byte 64 j + 4 r + c is value 4 j + c; 4-bit: byte 64 i + 4 r + c holds 8 i + c (low), 8 i + 4 + c
        const int u = bits == 8 ? q[(k / 4) * 64 + r * 4 + k % 4]
                                : (q[(k / 8) * 64 + r * 4 + k % 4] >> (k % 8 < 4 ? 0 : 4)) & 0x0F;
        const int64_t s = k / sub;
        const float value = d[s * kTileRows] * ((float)u - offset);
        o[k] = has_min ? value + m[s * kTileRows] : value;
      }
    }
  });
  return out;
}

// x [tokens, columns] float32 or bf16, quantized per token in blocks of kActivationBlock values to int8, times a
// weight packed by pack_int8 ([rows, columns] dequantized) transposed, with integer dot products: [tokens, rows]
// float32.
at::Tensor matmul_int8(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                       int64_t kind, int64_t group, int64_t rows, const std::string& isa_choice) {
  const Format format = format_of(kind, group);
  TORCH_CHECK((x.dtype() == at::kFloat || x.dtype() == at::kBFloat16) && x.dim() >= 1,
              "x must be float32 or bf16 [..., columns]");
  // Here rather than in the caller: each of these is a dispatched op from Python, ~1-3 us, four times a layer.
  const at::Tensor tokens_x = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t tokens = tokens_x.size(0), columns = tokens_x.size(1), tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t subs = columns / quantized_matmul::int8_sub_block(format.kind);
  TORCH_CHECK(columns % quantized_matmul::kActivationBlock == 0 && quants.dtype() == at::kByte &&
              quants.is_contiguous() && quants.dim() == 2 && quants.size(0) == tiles &&
              quants.size(1) == kTileRows * columns * quantized_matmul::int8_bits(format.kind) / 8 &&
              scales.is_contiguous() && scales.numel() == tiles * subs * kTileRows && mins.is_contiguous() &&
              mins.numel() == (quantized_matmul::int8_has_min(format.kind) ? scales.numel() : 0),
              "packed weight does not match x's columns, the rows or the format (pack it with pack_int8)");
  const quantized_matmul::Int8Kernels& kernels = int8_kernels(isa_choice);
  const int64_t blocks = columns / quantized_matmul::kActivationBlock;
  auto x_quants = at::empty({tokens, columns}, at::kChar);
  auto x_scales = at::empty({tokens, blocks}, at::kFloat);
  auto x_scaled_sums16 = at::empty({tokens, 2 * blocks}, at::kFloat);
  auto x_scaled_sums32 = at::empty({tokens, blocks}, at::kFloat);
  auto x_sums16 = at::empty({tokens, 2 * blocks}, at::kInt), x_sums32 = at::empty({tokens, blocks}, at::kInt);
  const bool bf16 = x.dtype() == at::kBFloat16;
  const float* x32 = bf16 ? nullptr : tokens_x.data_ptr<float>();
  const uint16_t* x16 = bf16 ? reinterpret_cast<const uint16_t*>(tokens_x.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, tokens, 16, [&](int64_t first, int64_t last) {
    kernels.quantize_activations(x32 ? x32 + first * columns : nullptr, x16 ? x16 + first * columns : nullptr,
                                 last - first, columns, x_quants.data_ptr<int8_t>() + first * columns,
                                 x_scales.data_ptr<float>() + first * blocks,
                                 x_scaled_sums16.data_ptr<float>() + first * 2 * blocks,
                                 x_scaled_sums32.data_ptr<float>() + first * blocks,
                                 x_sums16.data_ptr<int32_t>() + first * 2 * blocks,
                                 x_sums32.data_ptr<int32_t>() + first * blocks);
  });
  const quantized_matmul::Int8Activations activations{
      x_quants.data_ptr<int8_t>(),       x_scales.data_ptr<float>(),         x_scaled_sums16.data_ptr<float>(),
      x_scaled_sums32.data_ptr<float>(), x_sums16.data_ptr<int32_t>(), x_sums32.data_ptr<int32_t>(), tokens};
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = rows;
  auto out = at::empty(out_sizes, at::kFloat);
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    kernels.matmul_tiles(format, activations, quants.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                         mins.data_ptr<float>(), columns, first, last, rows, out.data_ptr<float>());
  });
  return out;
}

std::string int8_path() {
  if (has_amx_int8()) return "amx_int8";
  return has_avx512_vnni() ? "avx512_vnni" : best_isa() == Isa::Portable ? "portable" : "avx2";
}

std::string best_isa_name() { return isa_name(best_isa()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize", &dequantize, "float32 values of quantized rows");
  m.def("matmul", &matmul, "x @ dequantize(weight).T, dequantizing a tile of rows at a time");
  m.def("pack_int8", &pack_int8, "a quantized weight repacked for matmul_int8: quants, scales, mins");
  m.def("int8_rows", &int8_rows, "rows of a packed weight as float32: its dequantized values");
  m.def("matmul_int8", &matmul_int8, "int8-quantized x @ the packed weight's values.T, integer dot products");
  m.def("int8_path", &int8_path, "the path matmul_int8's auto takes here: amx_int8, avx512_vnni, avx2 or portable");
  m.def("best_isa", &best_isa_name, "the widest instruction set this CPU runs: avx512, avx2 or portable");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether this CPU runs the avx512_bf16 path (bf16 x)");
}
