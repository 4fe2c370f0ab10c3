// Paged decode attention over int8 KV caches (conveyor_kernels/kv_quant.py: each (token, kv head) row is head_dim int8
// values, then their float32 scale) and float32 ones: the Python module, its checks and the run-time choice of path.
// The body (vector_decode_body.h) is compiled twice, each in its own file so that ninja builds them in parallel: for
// AVX-512 (vector_decode_avx512.cpp, 16 float lanes) and for AVX2 + FMA (vector_decode_avx2.cpp, 8); the instruction
// set is chosen at run time from what the CPU reports, or forced by the caller, which is how the tests run both on
// one machine and the benchmark compares them. Built without -march=native so that the one build runs on any x86-64
// (as the quantized matmul). Other CPUs, head_dims, caches and queries take the CPU kernels' portable one
// (cpu_decode_attention.cpp; cpu_kernels.py dispatches).
// pybind11 and its Tensor conversions only: torch/extension.h adds the whole C++ frontend (torch/all.h), which
// nothing here uses and which took two thirds of this file's compile time.
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <type_traits>

#include "isa_dispatch.h"
#include "vector_decode.h"

namespace {

using isa_dispatch::Isa;
using isa_dispatch::best_isa;
using isa_dispatch::isa_name;
using isa_dispatch::parse_isa;
using vector_decode::kHeadDims;

// Where head_dim is among kHeadDims; std::size(kHeadDims) where it is not.
int64_t head_dim_index(int64_t head_dim) {
  return std::find(std::begin(kHeadDims), std::end(kHeadDims), head_dim) - std::begin(kHeadDims);
}

}  // namespace

bool supports(int64_t head_dim) { return head_dim_index(head_dim) < static_cast<int64_t>(std::size(kHeadDims)); }

std::string best_isa_name() { return isa_name(best_isa()); }

// The rows token_index[i] of `out` get sequence i's attention over its seq_lens[i] positions; other rows are left
// alone. Caches int8 [num_blocks, block_size, num_kv_heads, head_dim + 4] with float32 or bf16 query / out, or
// float32 [num_blocks, block_size, num_kv_heads, head_dim] with float32 query / out.
void decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                      at::Tensor seq_lens, at::Tensor token_index, at::Tensor out, double scale, int64_t window,
                      double softcap, const std::string& isa_choice) {
  const int64_t head_dim = query.size(2);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(supports(head_dim), "no vector decode kernel for head_dim ", head_dim);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v_cache.sizes() == k_cache.sizes(), "K and V caches alike");
  TORCH_CHECK(query.scalar_type() == out.scalar_type(), "query and out of one dtype");
  if (int8_cache) {
    TORCH_CHECK(k_cache.size(3) == head_dim + 4, "an int8 row is head_dim + 4 bytes");
    TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
                "float32 or bf16 queries over an int8 cache");
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat && query.scalar_type() == at::kFloat,
                "an int8 cache, or float32 queries over a float32 cache");
    TORCH_CHECK(k_cache.size(3) == head_dim, "a float32 row is head_dim values");
  }
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.stride(1) == head_dim, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(token_index.scalar_type() == at::kLong, "int64 token_index");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads a multiple of kv heads");
  const Isa isa = parse_isa(isa_choice);
  // Its portable path is the C++ CPU kernels' own (cpu_decode_attention.cpp), not this build's.
  TORCH_CHECK(isa != Isa::Portable, "no portable vector decode path here; this CPU has neither AVX-512 nor AVX2");
#if defined(__x86_64__) && defined(__GNUC__)
  const vector_decode::DecodeKernels& kernels =
      isa == Isa::Avx512 ? vector_decode::isa_avx512::decode_kernels : vector_decode::isa_avx2::decode_kernels;
  const int64_t index = head_dim_index(head_dim);
  const auto run = [&](auto kernel, auto* q, auto* cache_type) {
    using q_t = std::remove_const_t<std::remove_pointer_t<decltype(q)>>;
    using cache_t = std::remove_pointer_t<decltype(cache_type)>;
    kernel(q, query.stride(0), query.stride(1), static_cast<const cache_t*>(k_cache.data_ptr()),
           static_cast<const cache_t*>(v_cache.data_ptr()), block_tables.data_ptr<int32_t>(), block_tables.size(1),
           seq_lens.data_ptr<int32_t>(), token_index.data_ptr<int64_t>(), reinterpret_cast<q_t*>(out.data_ptr()),
           out.stride(0), seq_lens.size(0), query.size(1), k_cache.size(2), k_cache.size(1), static_cast<float>(scale),
           window, static_cast<float>(softcap));
  };
  if (!int8_cache) run(kernels.float32_cache[index], query.data_ptr<float>(), static_cast<float*>(nullptr));
  else if (query.scalar_type() == at::kFloat)
    run(kernels.int8_cache_float32[index], query.data_ptr<float>(), static_cast<int8_t*>(nullptr));
  else run(kernels.int8_cache_bf16[index], reinterpret_cast<const uint16_t*>(query.data_ptr()), static_cast<int8_t*>(nullptr));
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over an int8 or float32 KV cache (AVX-512 / AVX2)");
  m.def("supports", &supports, "whether decode_attention has a kernel for this head_dim");
  m.def("best_isa", &best_isa_name, "the widest path this CPU runs: avx512, avx2 or portable (the C++ CPU kernels' own)");
}
