// The C++ CPU kernels' Python module (cpu_kernels.py builds it): the bindings of the entry points that
// cpu_kernels.h declares, one file per concept beside this one.
// pybind11 and its Tensor conversions only: torch/extension.h adds the whole C++ frontend (torch/all.h), which
// nothing here uses and which took two thirds of this file's compile time.
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal attention of prefill chunks, bf16 (CPU, AVX-512 BF16)");
  m.def("prefill_attention_available", &prefill_attention_available, "whether paged_prefill_attention runs for this head_dim");
  m.def("greedy_sample", &greedy_sample, "each row's first maximum and its log-probability (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with an optional in-place residual add (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "disallowed tokens' float32 logits to -inf, in place (CPU)");
  m.def("rotary_in_place", &rotary_in_place, "neox rotary embedding in place, bf16/fp16 (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up, bf16/fp16 (CPU)");
  m.def("write_kv_cache", &write_kv_cache, "K/V rows into their paged cache slots (CPU)");
  m.def("encoder_attention", &encoder_attention, "packed bidirectional attention, bf16, head_dim 32 (CPU, AMX)");
  m.def("layer_norm", &layer_norm, "LayerNorm, bf16, at most 1024 wide (CPU, AVX-512 BF16)");
  m.def("encoder_kernels_available", &encoder_kernels_available, "whether encoder_attention and layer_norm run here");
}
