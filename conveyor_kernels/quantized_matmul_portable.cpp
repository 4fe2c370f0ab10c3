// The quantized matmul body (quantized_matmul_body.h) for any CPU: 4 float lanes, which GCC lowers to SSE2 on
// x86-64 and to NEON or scalar code elsewhere.
#include "quantized_matmul.h"

namespace quantized_matmul::isa_portable {
#define VEC_FLOATS 4
#include "quantized_matmul_body.h"
#include "quantized_matmul_int8.h"  // its int8-activation kernels, with the plain C++ dot product
#undef VEC_FLOATS
}  // namespace quantized_matmul::isa_portable
