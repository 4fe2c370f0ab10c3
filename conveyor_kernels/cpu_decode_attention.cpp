// Paged decode attention on the CPU: the portable kernel (any float dtype; float or int8 caches, dequantized as
// read) and, on a CPU with AVX-512 BF16, the bf16 kernel. The AVX-512 / AVX2 kernels of int8 and float32 caches are
// their own build (vector_decode.cpp).
#include "cpu_kernels.h"

#include <ATen/Dispatch.h>

#include <atomic>
#include <type_traits>

// One head's cache row to float: the row as it is for a float cache; for an int8 cache (conveyor_kernels/kv_quant.py) the n
// int8 values times the float32 scale stored in the 4 bytes after them, so that attention dequantizes on the fly
// what it reads once anyway (no dequantized copy of the cache).
template <typename cache_t>
static inline void widen_row(const cache_t* src, float* dst, int64_t n) {
  widen(src, dst, n);
}

template <>
inline void widen_row<int8_t>(const int8_t* src, float* dst, int64_t n) {
  float scale;
  std::memcpy(&scale, src + n, sizeof(float));  // unaligned: rows are n + 4 bytes apart
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 scales = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scales));
  }
#elif defined(__AVX2__)
  const __m256 scales = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scales));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

// The portable kernel; cache_t is the query's type, or int8_t for an int8 cache whose head rows are row_width =
// head_dim + 4 elements (the values, then their float32 scale).
template <typename scalar_t, typename cache_t>
static void decode_kernel(
    const scalar_t* query, int64_t query_row_stride, int64_t query_head_stride,
    const cache_t* k_cache, const cache_t* v_cache,
    const int32_t* block_tables, int64_t max_blocks,
    const int32_t* seq_lens, const int64_t* token_index,
    scalar_t* out, int64_t out_row_stride,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t row_width,
    int64_t block_size, float scale, int64_t window, float softcap) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * row_width;  // between consecutive tokens in the cache
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
      // A sliding window attends the last `window` positions; blocks before them may be freed (-1).
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      for (int64_t b = first / block_size; b < num_blocks; ++b) {
        const int64_t block = block_tables[seq * max_blocks + b];
        const int64_t skip = std::max<int64_t>(0, first - b * block_size);  // leading positions outside the window
        const int64_t tokens = std::min(block_size, length - b * block_size) - skip;
        const cache_t* k_block = k_cache + (block * block_size + skip) * slot_stride + kv_head * row_width;
        const cache_t* v_block = v_cache + (block * block_size + skip) * slot_stride + kv_head * row_width;
        // Widen (or dequantize) the block's K and V once; every query head of the group then reads floats.
        for (int64_t t = 0; t < tokens; ++t) {
          widen_row(k_block + t * slot_stride, &keys[t * head_dim], head_dim);
          widen_row(v_block + t * slot_stride, &values[t * head_dim], head_dim);
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
          if (softcap > 0.f) {
            for (t = 0; t < tokens; ++t) sj[t] = softcap * std::tanh(sj[t] / softcap);
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

#ifdef CONVEYOR_AVX512_BF16
// The interleave of two value rows by unpacklo/hi_epi16 works per 128-bit lane: of each 32 dims, the unpacklo
// accumulator holds dims 8L..8L+3 in lanes 4L..4L+3 (L: the 128-bit lane), the unpackhi accumulator dims
// 8L+4..8L+7. These are dims 16 * part .. 16 * part + 15 in order.
static inline __m512 unpermute_dims(__m512 lo, __m512 hi, int part) {
  const __m512i index = part == 0 ? _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23)
                                  : _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  return _mm512_permutex2var_ps(lo, index, hi);
}

// bf16 paged decode attention with AVX-512 BF16, head_dim = 32 * kChunks. A task is one sequence, taken a span of
// up to kSpan positions at a time (a span may cross blocks: each position's row is found through the block table),
// all its kv heads per span, each kv head's work prefetching the next one's rows (the next span's, after the last
// kv head; the following sequence's first, after its last span): blocks lie anywhere in the cache, and the
// hardware prefetcher would start over at each. Per kv head and span, the value rows of positions t and t + 1 are
// interleaved once (unpacklo/hi_epi16) for all the kv head's query heads. Then per query head and span:
//  - q.k by dpbf16ps straight from the cache's bf16 rows (exact products, float32 sums; the scale applied to the
//    float score), 16 keys at a time, their scores summed together (sum_lanes_16);
//  - one online-softmax step for the whole span in float32: one max, one correction, the probabilities by exp2_ps,
//    rounded to bf16 (as torch's bf16 flash attention rounds them for p.v) and summed as rounded, so that the
//    output is a weighted mean of the values with exactly the weights it was accumulated with;
//  - p.v by dpbf16ps: each pair (p_t, p_t+1) broadcast against the interleaved rows, into float32 accumulators
//    whose dims unpermute_dims puts back in order when the output is written.
template <int kChunks>
static void decode_kernel_bf16(
    const uint16_t* query, int64_t query_row_stride, int64_t query_head_stride,
    const uint16_t* k_cache, const uint16_t* v_cache,
    const int32_t* block_tables, int64_t max_blocks,
    const int32_t* seq_lens, const int64_t* token_index,
    uint16_t* out, int64_t out_row_stride,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
    float scale, int64_t window, float softcap) {
  constexpr int64_t kDim = 32 * kChunks, kLanes = 2 * kChunks;  // kLanes: float32 registers per row
  // Positions per softmax step: the more, the fewer maxima, corrections and sums per key; a span's interleaved
  // values (kSpan * kDim bf16) stay well within L1.
  constexpr int64_t kSpan = kChunks >= 8 ? 32 : 64, kPieces = kSpan / 16;
  // Independent p.v accumulator chains per row: about 8 keep dpbf16ps's latency hidden.
  constexpr int64_t kSets = kLanes >= 8 ? 1 : 8 / kLanes;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * kDim;
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  // Sequences are handed out one at a time: their lengths differ too much for equal shares of the count.
  std::atomic<int64_t> next_seq{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> acc(num_heads * kDim), running_max(num_heads), running_sum(num_heads);
    int64_t rows[2][kSpan];                 // this span's and the next one's rows: offsets into the caches
    alignas(64) uint32_t pairs[kSpan / 2];  // bf16 probabilities of positions 2i and 2i + 1
    __m512i values[kSpan / 2 * kLanes];     // value rows 2i and 2i + 1 interleaved
    const auto first_position = [&](int64_t seq) { return paged_rows::first_position(seq_lens[seq], window); };
    // The cache offsets of sequence seq's positions from `begin`, up to a span's worth; returns their count.
    const auto locate = [&](int64_t seq, int64_t begin, int64_t* span_rows) {
      return paged_rows::locate(block_tables + seq * max_blocks, block_size, slot_stride, seq_lens[seq], begin, kSpan,
                                span_rows);
    };
    // The sequence after this one is claimed a sequence ahead, for the last span to prefetch its first.
    int64_t span = 0;
    for (int64_t seq = next_seq++, following; seq < num_seqs; seq = following) {
      following = next_seq++;
      const int64_t length = seq_lens[seq];
      const int64_t row = token_index[seq];
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(running_max.begin(), running_max.end(), kNoScore);
      std::fill(running_sum.begin(), running_sum.end(), 0.f);
      locate(seq, first_position(seq), rows[span]);
      for (int64_t start = first_position(seq); start < length; start += kSpan, span ^= 1) {
        const int64_t n = std::min(kSpan, length - start);
        // Pairs past the span's last position carry zero probabilities and zero values.
        const int64_t num_pairs = ((n + 1) / 2 + kSets - 1) / kSets * kSets;
        const int64_t* span_rows = rows[span];
        const int64_t* next_rows = rows[span ^ 1];
        const int64_t next_n = start + kSpan < length ? locate(seq, start + kSpan, rows[span ^ 1])
                               : following < num_seqs ? locate(following, first_position(following), rows[span ^ 1])
                                                      : 0;
        for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
          const uint16_t* keys = k_cache + kv * kDim;
          const uint16_t* vals = v_cache + kv * kDim;
          // The next kv head's rows go to L2 a few at a time, spread over this kv head's work in `steps` steps (the
          // interleave's, then each query head's pieces): in one burst they stall the loads that need the data
          // now. always_inline: GCC deems a function that only prefetches pure, and drops the calls if it is
          // analysed before it is inlined.
          const bool last_head = kv + 1 == num_kv_heads;
          const int64_t* ahead_rows = last_head ? next_rows : span_rows;
          const int64_t ahead_n = last_head ? next_n : n;
          const uint16_t* ahead_keys = k_cache + (last_head ? 0 : kv + 1) * kDim;
          const uint16_t* ahead_vals = v_cache + (last_head ? 0 : kv + 1) * kDim;
          const int64_t steps = (group + 1) * kPieces;
          int64_t ahead_t = 0;
          const auto prefetch_step = [&](int64_t step) __attribute__((always_inline)) {
            for (const int64_t upto = (step + 1) * ahead_n / steps; ahead_t < upto; ++ahead_t) {
              for (int c = 0; c < kChunks; ++c) {
                __builtin_prefetch(ahead_keys + ahead_rows[ahead_t] + 32 * c, 0, 2);
                __builtin_prefetch(ahead_vals + ahead_rows[ahead_t] + 32 * c, 0, 2);
              }
            }
          };
          const __m512i zero = _mm512_setzero_si512();
          for (int64_t i = 0; i < num_pairs; ++i) {
            if (i % 8 == 0) prefetch_step(i / 8);
            for (int c = 0; c < kChunks; ++c) {
              const __m512i a = 2 * i < n ? _mm512_loadu_si512(vals + span_rows[2 * i] + 32 * c) : zero;
              const __m512i b = 2 * i + 1 < n ? _mm512_loadu_si512(vals + span_rows[2 * i + 1] + 32 * c) : zero;
              values[i * kLanes + 2 * c] = _mm512_unpacklo_epi16(a, b);
              values[i * kLanes + 2 * c + 1] = _mm512_unpackhi_epi16(a, b);
            }
          }
          for (int64_t j = 0; j < group; ++j) {
            const int64_t h = kv * group + j;
            const uint16_t* qh = query + row * query_row_stride + h * query_head_stride;
            __m512i q[kChunks];
            for (int c = 0; c < kChunks; ++c) q[c] = _mm512_loadu_si512(qh + 32 * c);
            __m512 scores[kPieces];
            for (int64_t piece = 0; piece < kPieces; ++piece) {
              if (16 * piece >= n) break;
              prefetch_step((j + 1) * kPieces + piece);
              __m512 partial[16];
              for (int64_t t = 0; t < 16; ++t) {
                __m512 dot = _mm512_setzero_ps();
                if (16 * piece + t < n) {
                  const uint16_t* key = keys + span_rows[16 * piece + t];
                  for (int c = 0; c < kChunks; ++c)
                    dot = _mm512_dpbf16_ps(dot, (__m512bh)q[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
                }
                partial[t] = dot;
              }
              scores[piece] = _mm512_mul_ps(sum_lanes_16(partial), _mm512_set1_ps(scale));
            }
            if (softcap > 0.f) {
              alignas(64) float s[kSpan];
              for (int64_t piece = 0; 16 * piece < n; ++piece) _mm512_store_ps(s + 16 * piece, scores[piece]);
              for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
              for (int64_t piece = 0; 16 * piece < n; ++piece) scores[piece] = _mm512_load_ps(s + 16 * piece);
            }
            __m512 top = _mm512_set1_ps(kNoScore);
            for (int64_t piece = 0; 16 * piece < n; ++piece)
              top = _mm512_mask_max_ps(top, first_lanes(n - 16 * piece), top, scores[piece]);
            const float new_max = std::max(running_max[h], _mm512_reduce_max_ps(top));
            const float correction = std::exp(running_max[h] - new_max);
            __m512 p[kPieces], total = _mm512_setzero_ps();
            for (int64_t piece = 0; piece < kPieces; ++piece) {
              p[piece] = _mm512_setzero_ps();
              if (16 * piece >= n) continue;
              const __m512 e = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(scores[piece], _mm512_set1_ps(new_max)), log2e));
              p[piece] = round_bf16(_mm512_maskz_mov_ps(first_lanes(n - 16 * piece), e));
              total = _mm512_add_ps(total, p[piece]);
            }
            running_sum[h] = running_sum[h] * correction + _mm512_reduce_add_ps(total);
            running_max[h] = new_max;
            for (int64_t k = 0; k < kPieces / 2; ++k)  // rounded already: the conversion is exact
              _mm512_store_si512(pairs + 16 * k, (__m512i)_mm512_cvtne2ps_pbh(p[2 * k + 1], p[2 * k]));
            float* ah = &acc[h * kDim];
            __m512 o[kSets][kLanes];
            for (int c = 0; c < kLanes; ++c) {
              o[0][c] = _mm512_mul_ps(_mm512_loadu_ps(ah + 16 * c), _mm512_set1_ps(correction));
              for (int64_t s = 1; s < kSets; ++s) o[s][c] = _mm512_setzero_ps();
            }
            for (int64_t i = 0; i < num_pairs; i += kSets) {
              for (int64_t s = 0; s < kSets; ++s) {
                const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[i + s]));
                for (int c = 0; c < kLanes; ++c)
                  o[s][c] = _mm512_dpbf16_ps(o[s][c], pair, (__m512bh)values[(i + s) * kLanes + c]);
              }
            }
            for (int c = 0; c < kLanes; ++c) {
              for (int64_t s = 1; s < kSets; ++s) o[0][c] = _mm512_add_ps(o[0][c], o[s][c]);
              _mm512_storeu_ps(ah + 16 * c, o[0][c]);
            }
          }
          prefetch_step(steps - 1);  // what a short span's steps left
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        uint16_t* dst = out + row * out_row_stride + h * kDim;
        const __m512 inv = _mm512_set1_ps(running_sum[h] > 0.f ? 1.f / running_sum[h] : 0.f);
        for (int c = 0; c < kChunks; ++c) {
          const __m512 lo = _mm512_loadu_ps(&acc[h * kDim + 32 * c]), hi = _mm512_loadu_ps(&acc[h * kDim + 32 * c + 16]);
          const __m512 first_half = _mm512_mul_ps(unpermute_dims(lo, hi, 0), inv);
          const __m512 second_half = _mm512_mul_ps(unpermute_dims(lo, hi, 1), inv);
          _mm512_storeu_si512(dst + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(second_half, first_half));
        }
      }
    }
  });
}
#endif

void paged_decode_attention(
    at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
    at::Tensor seq_lens, at::Tensor token_index, at::Tensor out, double scale, int64_t window,
    double softcap) {
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.stride(1) == out.size(2), "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(token_index.scalar_type() == at::kLong, "int64 token_index");
#ifdef CONVEYOR_AVX512_BF16
  const int64_t head_dim = k_cache.size(3);
  if (query.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && head_dim % 32 == 0 &&
      (head_dim / 32) <= 8 && ((head_dim / 32) & (head_dim / 32 - 1)) == 0) {
    const auto run = [&](auto chunks) {
      decode_kernel_bf16<decltype(chunks)::value>(
          reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>()), query.stride(0), query.stride(1),
          reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
          reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()),
          block_tables.data_ptr<int32_t>(), block_tables.size(1),
          seq_lens.data_ptr<int32_t>(), token_index.data_ptr<int64_t>(),
          reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out.stride(0),
          seq_lens.size(0), query.size(1), k_cache.size(2), k_cache.size(1),
          static_cast<float>(scale), window, static_cast<float>(softcap));
    };
    switch (head_dim / 32) {
      case 1: run(std::integral_constant<int, 1>{}); return;
      case 2: run(std::integral_constant<int, 2>{}); return;
      case 4: run(std::integral_constant<int, 4>{}); return;
      default: run(std::integral_constant<int, 8>{}); return;
    }
  }
#endif
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches of one dtype");
  if (k_cache.scalar_type() == at::kChar) {  // int8 rows of head_dim values and their float32 scale
    const int64_t head_dim = k_cache.size(3) - 4;
    TORCH_CHECK(head_dim == query.size(2), "an int8 cache row is head_dim + 4 bytes");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention_int8", [&] {
      decode_kernel<scalar_t, int8_t>(
          query.data_ptr<scalar_t>(), query.stride(0), query.stride(1),
          k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
          block_tables.data_ptr<int32_t>(), block_tables.size(1),
          seq_lens.data_ptr<int32_t>(), token_index.data_ptr<int64_t>(),
          out.data_ptr<scalar_t>(), out.stride(0),
          seq_lens.size(0), query.size(1), k_cache.size(2), head_dim, k_cache.size(3), k_cache.size(1),
          static_cast<float>(scale), window, static_cast<float>(softcap));
    });
    return;
  }
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type(), "a float cache has the query's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t, scalar_t>(
        query.data_ptr<scalar_t>(), query.stride(0), query.stride(1),
        k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        block_tables.data_ptr<int32_t>(), block_tables.size(1),
        seq_lens.data_ptr<int32_t>(), token_index.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), out.stride(0),
        seq_lens.size(0), query.size(1), k_cache.size(2), k_cache.size(3), k_cache.size(3), k_cache.size(1),
        static_cast<float>(scale), window, static_cast<float>(softcap));
  });
}
