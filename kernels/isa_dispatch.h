// The run-time choice of instruction set for the C++ kernels that compile a body per set (quantized_matmul.cpp,
// kv_int8_decode.cpp): the widest this CPU runs, and a requested one checked against it.
#pragma once
#include <c10/util/Exception.h>

#include <string>

namespace isa_dispatch {

enum class Isa { Portable, Avx2, Avx512 };

inline Isa best_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
#endif
  return Isa::Portable;
}

inline const char* isa_name(Isa isa) {
  return isa == Isa::Avx512 ? "avx512" : isa == Isa::Avx2 ? "avx2" : "portable";
}

// "auto" (the best), "avx512", "avx2" or "portable"; a set this CPU cannot run is refused.
inline Isa parse_isa(const std::string& name) {
  const Isa best = best_isa();
  if (name == "auto") return best;
  Isa wanted;
  if (name == "avx512") wanted = Isa::Avx512;
  else if (name == "avx2") wanted = Isa::Avx2;
  else if (name == "portable") wanted = Isa::Portable;
  else TORCH_CHECK(false, "isa must be auto, avx512, avx2 or portable; got ", name);
  TORCH_CHECK((int)wanted <= (int)best, "this CPU cannot run the ", name, " path (best: ", isa_name(best), ")");
  return wanted;
}

}  // namespace isa_dispatch
