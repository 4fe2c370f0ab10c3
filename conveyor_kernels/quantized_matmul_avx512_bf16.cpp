// The quantized matmul's bf16 path (quantized_matmul_bf16.h) for AVX-512 BF16, in its own file so that ninja builds
// it beside the others. Everything it includes comes first, outside the target pragma (see
// quantized_matmul_avx512.cpp); avx512_math.h's helpers are AVX-512 code by nature, so they go inside it.
#include <immintrin.h>

#include <type_traits>

#include "quantized_matmul.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")
#include "avx512_math.h"  // sum_lanes_16
namespace quantized_matmul::isa_avx512_bf16 {
#include "quantized_matmul_bf16.h"
}  // namespace quantized_matmul::isa_avx512_bf16
#pragma GCC pop_options
#endif
