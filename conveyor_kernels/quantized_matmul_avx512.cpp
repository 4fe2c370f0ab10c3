// The quantized matmul body (quantized_matmul_body.h) for AVX-512: 16 float lanes. Everything it includes comes
// first, outside the target pragma, so that no inline function shared with the other files is compiled for AVX-512
// (the linker keeps one copy of each, and this one would stop a CPU without AVX-512).
#include "quantized_matmul.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")
namespace quantized_matmul::isa_avx512 {
#define VEC_FLOATS 16
#include "quantized_matmul_body.h"
#undef VEC_FLOATS
}  // namespace quantized_matmul::isa_avx512
#pragma GCC pop_options
#endif
