// The CPU kernels over a step's logits: the structured-output bitmask and the greedy pick with its log-probability.
#include "cpu_kernels.h"

#include <ATen/ops/empty.h>

// Structured output: the logits of each row's disallowed tokens become -inf, in place; bit j of word w of a row's
// mask allows token 32 * w + j. A constrained row is mostly whole words of zeros (a JSON key allows a handful of
// ~50k tokens), filled without looking at their bits. -inf is stored as its bit pattern: -ffast-math lets the
// compiler assume no float is infinite.
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask needs float32 logits [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask needs a contiguous int32 bitmask [rows, ceil(vocab / 32)]");
  constexpr uint32_t kNegativeInfinity = 0xff800000u;
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1), stride = logits.stride(0);
  uint32_t* base = reinterpret_cast<uint32_t*>(logits.data_ptr<float>());
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint32_t* row = base + r * stride;
      const uint32_t* mask = masks + r * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t bits = mask[w];
        if (bits == 0xffffffffu) continue;
        uint32_t* out = row + w * 32;
        const int64_t n = std::min<int64_t>(32, vocab - w * 32);
        if (bits == 0) {
          for (int64_t j = 0; j < n; ++j) out[j] = kNegativeInfinity;
        } else {
          for (int64_t j = 0; j < n; ++j)
            if (!((bits >> j) & 1u)) out[j] = kNegativeInfinity;
        }
      }
    }
  });
}

// Greedy picks without logit processing: each row's first maximum and its log-probability, max - logsumexp, in
// three passes over the row while it sits in L2 (torch: a float32 copy, then max and logsumexp's two passes).
#ifdef CONVEYOR_AVX512_BF16
static inline __m512 load_logits(const float* p, __mmask16 lanes) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(kNoScore), lanes, p);
}

static inline __m512 load_logits(const c10::BFloat16* p, __mmask16 lanes) {
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16);
  return _mm512_mask_blend_ps(lanes, _mm512_set1_ps(kNoScore), _mm512_castsi512_ps(bits));
}

template <typename T>
static void greedy_row(const T* row, int64_t vocab, int64_t* token, float* logprob) {
  __m512 best = _mm512_set1_ps(kNoScore);
  for (int64_t j = 0; j < vocab; j += 16) best = _mm512_max_ps(best, load_logits(row + j, first_lanes(vocab - j)));
  const float top = _mm512_reduce_max_ps(best);
  const __m512 shift = _mm512_set1_ps(top * 1.44269504088896341f), log2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < vocab; j += 16) {
    const __mmask16 lanes = first_lanes(vocab - j);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(lanes, exp2_ps(_mm512_fmsub_ps(load_logits(row + j, lanes), log2e, shift))));
  }
  *logprob = -std::log(_mm512_reduce_add_ps(sum));
  for (int64_t j = 0;; j += 16) {
    const __mmask16 hits = _mm512_cmp_ps_mask(load_logits(row + j, first_lanes(vocab - j)), _mm512_set1_ps(top), _CMP_EQ_OQ);
    if (hits) {
      *token = j + __builtin_ctz(hits);
      return;
    }
  }
}
#else
template <typename T>
static void greedy_row(const T* row, int64_t vocab, int64_t* token, float* logprob) {
  int64_t first = 0;
  for (int64_t j = 1; j < vocab; ++j)
    if (static_cast<float>(row[j]) > static_cast<float>(row[first])) first = j;
  const float top = static_cast<float>(row[first]);
  float sum = 0.f;
  for (int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<float>(row[j]) - top);
  *token = first;
  *logprob = -std::log(sum);
}
#endif

// logits [rows, vocab] float32 or bf16 with contiguous rows -> (token ids [rows] int64, log-probs [rows] float32).
std::tuple<at::Tensor, at::Tensor> greedy_sample(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "greedy_sample needs [rows, vocab] with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, "float32 or bf16 logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto tokens = at::empty({rows}, at::kLong);
  auto logprobs = at::empty({rows}, at::kFloat);
  int64_t* token = tokens.data_ptr<int64_t>();
  float* logprob = logprobs.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (logits.scalar_type() == at::kFloat)
        greedy_row(logits.data_ptr<float>() + r * stride, vocab, token + r, logprob + r);
      else
        greedy_row(logits.data_ptr<at::BFloat16>() + r * stride, vocab, token + r, logprob + r);
    }
  });
  return {tokens, logprobs};
}
