// The one-pass ops of a decoder layer on the CPU, beside its attention: residual-add RMSNorm, in-place rotary
// embedding, SwiGLU's silu(gate) * up, and the K/V cache write.
#include "cpu_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

// RMSNorm over the last dimension, optionally after adding a residual (then `residual` is updated
// in place to x + residual, rounded to the tensor's dtype as an unfused add would be). Statistics
// in float32; the normalised value is rounded before the weight multiplies it, as Hugging Face
// Llama does, so float32 runs match it and bf16 runs round the same way.
template <typename scalar_t>
static void rms_norm_kernel(const scalar_t* x, scalar_t* residual, const scalar_t* weight, scalar_t* out,
                            int64_t rows, int64_t size, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kSerialElements / size), [&](int64_t begin, int64_t end) {
    std::vector<float> h(size);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * size;
      float sum_sq = 0.f;
      if (residual != nullptr) {
        scalar_t* rr = residual + r * size;
        for (int64_t i = 0; i < size; ++i) {
          const scalar_t added = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          rr[i] = added;
          h[i] = static_cast<float>(added);
        }
      } else {
        for (int64_t i = 0; i < size; ++i) h[i] = static_cast<float>(xr[i]);
      }
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < size; ++i) sum_sq += h[i] * h[i];
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(size) + eps);
      scalar_t* o = out + r * size;
      for (int64_t i = 0; i < size; ++i) {
        const float normed = static_cast<float>(static_cast<scalar_t>(h[i] * inv));
        o[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * normed);
      }
    }
  });
}

#ifdef CONVEYOR_AVX512_BF16
// rms_norm_kernel for bf16 rows a multiple of 16 wide, 16 lanes at a time, rounding where it rounds (c10's scalar
// bf16 conversions kept that kernel at ~60 us for 64 rows of 576).
static void rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out, int64_t rows,
                          int64_t size, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kSerialElements / size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* normalised = x + r * size;  // x, or x + residual as rounded into the residual
      __m512 sum_sq = _mm512_setzero_ps();
      if (residual != nullptr) {
        uint16_t* summed = residual + r * size;
        for (int64_t i = 0; i < size; i += 16) {
          const __m512 added = round_bf16(_mm512_add_ps(load_bf16(normalised + i), load_bf16(summed + i)));
          store_bf16(summed + i, added);
          sum_sq = _mm512_fmadd_ps(added, added, sum_sq);
        }
        normalised = summed;
      } else {
        for (int64_t i = 0; i < size; i += 16) {
          const __m512 v = load_bf16(normalised + i);
          sum_sq = _mm512_fmadd_ps(v, v, sum_sq);
        }
      }
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sum_sq) / static_cast<float>(size) + eps));
      uint16_t* o = out + r * size;
      for (int64_t i = 0; i < size; i += 16) {
        const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(normalised + i), inv));
        store_bf16(o + i, round_bf16(_mm512_mul_ps(load_bf16(weight + i), normed)));
      }
    }
  });
}
#endif

at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  TORCH_CHECK(!residual.has_value() || residual->is_contiguous(), "rms_norm needs a contiguous residual");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and input dtypes differ");
  auto out = at::empty_like(x);
  const int64_t size = x.size(-1);
#ifdef CONVEYOR_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16 && size % 16 == 0) {
    const auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    rms_norm_bf16(bits(x), residual.has_value() ? bits(*residual) : nullptr, bits(weight), bits(out), x.numel() / size,
                  size, static_cast<float>(eps));
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                              weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.numel() / size, size,
                              static_cast<float>(eps));
  });
  return out;
}

// Rotary embedding (neox style: the first half of a head rotates with the second half) in place, over `heads`
// heads of each row, for float32, bfloat16 and float16. Every product and sum is rounded to the dtype as torch's
// separate ops round them (a product of two bf16 or fp16 values is exact in float32), so the result is the torch
// expression's bit for bit, in one pass instead of seven ops. Float32's products are rounded before they are added
// only without contraction: -ffast-math's fused multiply-adds would round each sum once, so not here (a pragma: the
// loop is a lambda, which a function attribute would not reach).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename scalar_t>
static void rotary_kernel(scalar_t* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                          const scalar_t* cos, const scalar_t* sin) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, std::max<int64_t>(1, kSerialElements / (heads * head_dim)), [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half);
    for (int64_t r = begin; r < end; ++r) {
      widen(cos + r * half, c.data(), half);
      widen(sin + r * half, s.data(), half);
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* x1 = x + r * row_stride + h * head_dim;
        scalar_t* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
          const float first = static_cast<float>(static_cast<scalar_t>(a * c[i])) -
                              static_cast<float>(static_cast<scalar_t>(b * s[i]));
          const float second = static_cast<float>(static_cast<scalar_t>(b * c[i])) +
                               static_cast<float>(static_cast<scalar_t>(a * s[i]));
          x1[i] = static_cast<scalar_t>(first);
          x2[i] = static_cast<scalar_t>(second);
        }
      }
    }
  });
}
#pragma GCC pop_options

#ifdef CONVEYOR_AVX512_BF16
// rotary_kernel for bf16, 16 lanes at a time (head_dim / 2 a multiple of 16).
static void rotary_bf16(uint16_t* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                        const uint16_t* cos, const uint16_t* sin) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, std::max<int64_t>(1, kSerialElements / (heads * head_dim)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 c = load_bf16(cos + r * half + i), s = load_bf16(sin + r * half + i);
        for (int64_t h = 0; h < heads; ++h) {
          uint16_t* x1 = x + r * row_stride + h * head_dim + i;
          uint16_t* x2 = x1 + half;
          const __m512 a = load_bf16(x1), b = load_bf16(x2);
          store_bf16(x1, round_bf16(_mm512_sub_ps(round_bf16(_mm512_mul_ps(a, c)), round_bf16(_mm512_mul_ps(b, s)))));
          store_bf16(x2, round_bf16(_mm512_add_ps(round_bf16(_mm512_mul_ps(b, c)), round_bf16(_mm512_mul_ps(a, s)))));
        }
      }
    }
  });
}

// silu_and_mul_kernel for bf16, 16 lanes at a time (width a multiple of 16); exp by exp2_ps.
static void silu_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t width) {
  const __m512 minus_log2e = _mm512_set1_ps(-1.44269504088896341f), one = _mm512_set1_ps(1.f);
  at::parallel_for(0, rows, std::max<int64_t>(1, kSerialElements / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* gate = gate_up + r * 2 * width;
      const uint16_t* up = gate + width;
      uint16_t* o = out + r * width;
      for (int64_t i = 0; i < width; i += 16) {
        const __m512 g = load_bf16(gate + i);
        const __m512 activated = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp2_ps(_mm512_mul_ps(g, minus_log2e)))));
        store_bf16(o + i, round_bf16(_mm512_mul_ps(activated, load_bf16(up + i))));
      }
    }
  });
}
#endif

// x: [T, heads, head_dim] (heads and head_dim contiguous within a row; rows may be strided, as slices of a fused
// projection are); cos, sin: [T, head_dim / 2] contiguous, already rounded to x's dtype.
void rotary_in_place(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "heads must be contiguous within a row");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) / 2 &&
                  sin.numel() == cos.numel(), "cos and sin must be [T, head_dim / 2] and contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "one dtype");
#ifdef CONVEYOR_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16 && x.size(2) % 32 == 0) {
    rotary_bf16(reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>()), x.size(0), x.stride(0), x.size(1), x.size(2),
                reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>()));
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_in_place", [&] {
    rotary_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.stride(0), x.size(1), x.size(2),
                            cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
  });
}

// SwiGLU's activation: silu(gate) * up of rows laid out [gate | up], for bfloat16 and float16, rounded as torch's
// F.silu(gate) * up rounds (silu in float32, rounded, then the product rounded): one pass instead of two ops and
// the activation's temporary. exp may differ from torch's in its last float bit, which rounding to 8 (or 11)
// mantissa bits almost always hides.
template <typename scalar_t>
static void silu_and_mul_kernel(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kSerialElements / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = gate_up + r * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* o = out + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float activated = static_cast<float>(static_cast<scalar_t>(g / (1.f + std::exp(-g))));
        o[i] = static_cast<scalar_t>(activated * static_cast<float>(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_and_mul needs contiguous [.., 2 * width]");
  const int64_t width = gate_up.size(-1) / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width;
  auto out = at::empty(sizes, gate_up.options());
#ifdef CONVEYOR_AVX512_BF16
  if (gate_up.scalar_type() == at::kBFloat16 && width % 16 == 0) {
    silu_and_mul_bf16(reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>()),
                      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), gate_up.numel() / (2 * width), width);
    return out;
  }
#endif
  AT_DISPATCH_REDUCED_FLOATING_TYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.numel() / (2 * width),
                                  width);
  });
  return out;
}

// Copies each token's K and V rows ([T, kv_heads, head_dim], heads contiguous within a row) into its cache slot
// (slot -1: dropped): one op for what index_copy_ does in two plus the padding check.
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slot_mapping) {
  const int64_t tokens = key.size(0), row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) * key.size(2) == row, "[T, kv_heads, D]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2), "heads must be contiguous within a row");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(), "caches");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(), "dtypes");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens, "int64 slot_mapping, one per token");
  const int64_t slots = k_cache.size(0) * k_cache.size(1), bytes = row * key.element_size();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      TORCH_CHECK(slot[t] < slots, "slot ", slot[t], " is outside the cache");
      std::memcpy(k_dst + slot[t] * bytes, k_src + t * k_stride, bytes);
      std::memcpy(v_dst + slot[t] * bytes, v_src + t * v_stride, bytes);
    }
  });
}
