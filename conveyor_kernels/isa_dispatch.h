// The run-time choice of instruction set for the C++ kernels that compile a body per set (quantized_matmul.cpp,
// vector_decode.cpp): the widest this CPU runs, and a requested one checked against it; and AVX-512 BF16 and
// VNNI, which only the quantized matmul's bf16 and int8-activation paths use. CONVEYOR_CPU_ISA=avx2 (or portable)
// caps all of them below what the CPU runs, so that an AVX-512 machine can stand in for an AVX2-only one
// (conveyor_kernels/cpu_kernels.py's cpu_isa_cap reads the same variable for the -march of the other kernels).
#pragma once
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace isa_dispatch {

enum class Isa { Portable, Avx2, Avx512 };

// The cap CONVEYOR_CPU_ISA sets (unset or empty: none), read once a process.
inline Isa isa_cap() {
  static const Isa cap = [] {
    const char* value = std::getenv("CONVEYOR_CPU_ISA");
    const std::string name = value == nullptr ? "" : value;
    TORCH_CHECK(name.empty() || name == "avx2" || name == "portable",
                "CONVEYOR_CPU_ISA must be avx2 or portable (or unset); got ", name);
    return name == "portable" ? Isa::Portable : name == "avx2" ? Isa::Avx2 : Isa::Avx512;
  }();
  return cap;
}

inline Isa cpu_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
#endif
  return Isa::Portable;
}

// The widest set this CPU runs, under the cap.
inline Isa best_isa() {
  const Isa cpu = cpu_isa(), cap = isa_cap();
  return (int)cpu < (int)cap ? cpu : cap;
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

// AVX-512 BF16 (vcvtne2ps2bf16, vdpbf16ps: products of bf16 pairs summed into float32 lanes) on top of the
// AVX-512 set. A capability beside the order above rather than a step in it: only a kernel with a bf16 body asks
// (quantized_matmul.cpp, for bf16 x), so the other kernels' paths stay portable < avx2 < avx512.
inline bool has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  return best_isa() == Isa::Avx512 && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AVX-512 VNNI (vpdpbusd: products of unsigned by signed bytes, four summed into each int32 lane), which only the
// quantized matmul's int8-activation path uses, likewise beside the order.
inline bool has_avx512_vnni() {
#if defined(__x86_64__) && defined(__GNUC__)
  return best_isa() == Isa::Avx512 && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// AMX's tile registers, which Linux lends a process only on request (once a process; a hypervisor can refuse it
// while the CPU flags still show AMX).
inline bool amx_permitted() {
#if defined(__x86_64__) && defined(__linux__)
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return permitted;
#else
  return false;
#endif
}

// AMX-INT8 (tdpbsud: a 16 x 64 tile of signed bytes by a 16 x 64 one of unsigned, int32 sums), which only the
// quantized matmul's int8-activation path uses, beside the order like VNNI; every such CPU has AVX-512 VNNI too.
inline bool has_amx_int8() {
#if defined(__x86_64__) && defined(__GNUC__)
  return has_avx512_vnni() && __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("amx-tile") &&
         amx_permitted();
#else
  return false;
#endif
}

}  // namespace isa_dispatch
