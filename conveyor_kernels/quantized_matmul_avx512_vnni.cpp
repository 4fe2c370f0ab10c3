// The quantized matmul's int8-activation body (quantized_matmul_int8.h) for AVX-512 VNNI: vpdpbusd dot products and
// an AVX-512 transpose of the tile. In its own file so that ninja builds it beside the others; everything it
// includes comes first, outside the target pragma (see quantized_matmul_avx512.cpp).
#include <immintrin.h>

#include "quantized_matmul.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2")
namespace quantized_matmul::isa_avx512_vnni {
#define INT8_VNNI 1
#include "quantized_matmul_int8.h"
#undef INT8_VNNI
}  // namespace quantized_matmul::isa_avx512_vnni
#pragma GCC pop_options
#endif
