#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// Widen n values to float. The bfloat16 case is spelled as the bit shift it is, which the compiler
// vectorizes; c10::BFloat16's conversion operator it does not.
template <typename scalar_t>
static inline void widen(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// Below any real score, and finite: the kernels are built with -ffast-math (vectorized exp),
// under which infinities are not allowed. exp(kNoScore - score) is exactly 0.
constexpr float kNoScore = -1e30f;

template <typename scalar_t>
static void decode_kernel(
    const scalar_t* query, int64_t query_row_stride, int64_t query_head_stride,
    const scalar_t* k_cache, const scalar_t* v_cache,
    const int32_t* block_tables, int64_t max_blocks,
    const int32_t* seq_lens, const int64_t* token_index,
    scalar_t* out, int64_t out_row_stride,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;  // between consecutive tokens in the cache
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores(group * block_size);
    std::vector<float> keys(block_size * head_dim), values(block_size * head_dim);
    std::vector<float> running_max(group), running_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t length = seq_lens[seq];
      const int64_t row = token_index[seq];
      for (int64_t j = 0; j < group; ++j) {
        const scalar_t* src = query + row * query_row_stride + (kv_head * group + j) * query_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) q[j * head_dim + d] = static_cast<float>(src[d]) * scale;
        running_max[j] = kNoScore;
        running_sum[j] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t num_blocks = (length + block_size - 1) / block_size;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t block = block_tables[seq * max_blocks + b];
        const int64_t tokens = std::min(block_size, length - b * block_size);
        const scalar_t* k_block = k_cache + block * block_size * slot_stride + kv_head * head_dim;
        const scalar_t* v_block = v_cache + block * block_size * slot_stride + kv_head * head_dim;
        // Widen the block's K and V once; every query head of the group then reads floats.
        for (int64_t t = 0; t < tokens; ++t) {
          widen(k_block + t * slot_stride, &keys[t * head_dim], head_dim);
          widen(v_block + t * slot_stride, &values[t * head_dim], head_dim);
        }
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = &q[j * head_dim];
          float* sj = &scores[j * block_size];
          // Four tokens per pass: four independent accumulators hide the reduction latency.
          int64_t t = 0;
          for (; t + 4 <= tokens; t += 4) {
            const float* k0 = &keys[t * head_dim];
            const float *k1 = k0 + head_dim, *k2 = k1 + head_dim, *k3 = k2 + head_dim;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t d = 0; d < head_dim; ++d) {
              s0 += qj[d] * k0[d];
              s1 += qj[d] * k1[d];
              s2 += qj[d] * k2[d];
              s3 += qj[d] * k3[d];
            }
            sj[t] = s0, sj[t + 1] = s1, sj[t + 2] = s2, sj[t + 3] = s3;
          }
          for (; t < tokens; ++t) {
            const float* k = &keys[t * head_dim];
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qj[d] * k[d];
            sj[t] = s;
          }
          float block_max = kNoScore;
          for (t = 0; t < tokens; ++t) block_max = std::max(block_max, sj[t]);
          const float new_max = std::max(running_max[j], block_max);
          const float correction = std::exp(running_max[j] - new_max);
          float* aj = &acc[j * head_dim];
          float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t t = 0; t < tokens; ++t) {
            sj[t] = std::exp(sj[t] - new_max);
            block_sum += sj[t];
          }
          running_sum[j] = running_sum[j] * correction + block_sum;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) aj[d] *= correction;
          for (t = 0; t + 4 <= tokens; t += 4) {
            const float p0 = sj[t], p1 = sj[t + 1], p2 = sj[t + 2], p3 = sj[t + 3];
            const float* v0 = &values[t * head_dim];
            const float *v1 = v0 + head_dim, *v2 = v1 + head_dim, *v3 = v2 + head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) aj[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
          }
          for (; t < tokens; ++t) {
            const float p = sj[t];
            const float* v = &values[t * head_dim];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) aj[d] += p * v[d];
          }
          running_max[j] = new_max;
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        scalar_t* dst = out + row * out_row_stride + (kv_head * group + j) * head_dim;
        const float inv = running_sum[j] > 0.f ? 1.f / running_sum[j] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[j * head_dim + d] * inv);
      }
    }
  });
}

void paged_decode_attention(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, torch::Tensor token_index, torch::Tensor out, double scale) {
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.stride(1) == out.size(2), "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(token_index.scalar_type() == torch::kInt64, "int64 token_index");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(
        query.data_ptr<scalar_t>(), query.stride(0), query.stride(1),
        k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        block_tables.data_ptr<int32_t>(), block_tables.size(1),
        seq_lens.data_ptr<int32_t>(), token_index.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), out.stride(0),
        seq_lens.size(0), query.size(1), k_cache.size(2), k_cache.size(3), k_cache.size(1),
        static_cast<float>(scale));
  });
}

// RMSNorm over the last dimension, optionally after adding a residual (then `residual` is updated
// in place to x + residual, rounded to the tensor's dtype as an unfused add would be). Statistics
// in float32; the normalised value is rounded before the weight multiplies it, as Hugging Face
// Llama does, so float32 runs match it and bf16 runs round the same way.
template <typename scalar_t>
static void rms_norm_kernel(const scalar_t* x, scalar_t* residual, const scalar_t* weight, scalar_t* out,
                            int64_t rows, int64_t size, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
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

torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  TORCH_CHECK(!residual.has_value() || residual->is_contiguous(), "rms_norm needs a contiguous residual");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and input dtypes differ");
  auto out = torch::empty_like(x);
  const int64_t size = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                              weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.numel() / size, size,
                              static_cast<float>(eps));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with an optional in-place residual add (CPU)");
}
