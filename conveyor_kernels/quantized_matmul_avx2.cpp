// The quantized matmul body (quantized_matmul_body.h) for AVX2 + FMA: 8 float lanes. Everything it includes comes
// first, outside the target pragma, so that no inline function shared with the other files is compiled for AVX2
// (the linker keeps one copy of each, and this one would stop a CPU without AVX2).
#include <immintrin.h>

#include "quantized_matmul.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace quantized_matmul::isa_avx2 {
#define VEC_FLOATS 8
#include "quantized_matmul_body.h"
#define INT8_AVX2 1
#include "quantized_matmul_int8.h"  // its int8-activation kernels, with vpmaddubsw dot products
#undef INT8_AVX2
#undef VEC_FLOATS
}  // namespace quantized_matmul::isa_avx2
#pragma GCC pop_options
#endif
