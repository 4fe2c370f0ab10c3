#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>
// Built with -march=native: the instruction sets are the build machine's, and the build is per CPU (see
// cpu_kernels.py). Without AVX-512 BF16 the decode attention keeps its portable kernel.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#include <immintrin.h>
#define CONVEYOR_AVX512_BF16 1
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>  // the int8 KV rows' dequantization (widen_row)
#endif
#if defined(CONVEYOR_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define CONVEYOR_AMX 1
#endif

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

// One head's cache row to float: the row as it is for a float cache; for an int8 cache (kernels/kv_quant.py) the n
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

// Below any real score, and finite: the kernels are built with -ffast-math (vectorized exp),
// under which infinities are not allowed. exp(kNoScore - score) is exactly 0.
constexpr float kNoScore = -1e30f;

// The elementwise kernels keep work under this many elements on one thread: a parallel region costs microseconds,
// and on a loaded machine one of its threads waiting for a core stalls the whole region (a decode step runs
// hundreds of them).
constexpr int64_t kSerialElements = 65536;

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
#include "avx512_math.h"  // exp2_ps, sum_lanes_16

static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (1u << n) - 1; }

static inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// float32 -> bf16 rounding kept in float32 lanes (the low 16 bits cleared): round to nearest even, as
// c10::BFloat16 rounds.
static inline __m512 round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 16 floats already rounded by round_bf16, stored as bf16.
static inline void store_bf16(uint16_t* p, __m512 rounded) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}

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
    // A sliding window attends the last `window` positions; blocks before them may be freed (-1).
    const auto first_position = [&](int64_t seq) {
      return window > 0 ? std::max<int64_t>(0, seq_lens[seq] - window) : int64_t{0};
    };
    // The cache offsets of sequence seq's positions from `begin`, up to a span's worth; returns their count.
    const auto locate = [&](int64_t seq, int64_t begin, int64_t* span_rows) {
      const int32_t* table = block_tables + seq * max_blocks;
      const int64_t count = std::min<int64_t>(kSpan, seq_lens[seq] - begin);
      for (int64_t t = 0, b = begin / block_size, slot = begin % block_size; t < count; ++t) {
        span_rows[t] = (table[b] * block_size + slot) * slot_stride;
        if (++slot == block_size) slot = 0, ++b;
      }
      return std::max<int64_t>(0, count);
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
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, torch::Tensor token_index, torch::Tensor out, double scale, int64_t window,
    double softcap) {
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.stride(1) == out.size(2), "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(token_index.scalar_type() == torch::kInt64, "int64 token_index");
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

torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  TORCH_CHECK(!residual.has_value() || residual->is_contiguous(), "rms_norm needs a contiguous residual");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and input dtypes differ");
  auto out = torch::empty_like(x);
  const int64_t size = x.size(-1);
#ifdef CONVEYOR_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16 && size % 16 == 0) {
    const auto bits = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
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
// heads of each row, for bfloat16 and float16. Every product and sum is rounded to the dtype as torch's separate
// ops round them (a product of two bf16 or fp16 values is exact in float32), so the result is the torch
// expression's bit for bit, in one pass instead of seven ops. Float32 stays on torch: there the fused multiply-adds
// that -ffast-math allows would round differently.
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
void rotary_in_place(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
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
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "rotary_in_place", [&] {
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

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_and_mul needs contiguous [.., 2 * width]");
  const int64_t width = gate_up.size(-1) / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width;
  auto out = torch::empty(sizes, gate_up.options());
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
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  const int64_t tokens = key.size(0), row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) * key.size(2) == row, "[T, kv_heads, D]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2), "heads must be contiguous within a row");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(), "caches");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(), "dtypes");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
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

// Structured output: the logits of each row's disallowed tokens become -inf, in place; bit j of word w of a row's
// mask allows token 32 * w + j. A constrained row is mostly whole words of zeros (a JSON key allows a handful of
// ~50k tokens), filled without looking at their bits. -inf is stored as its bit pattern: -ffast-math lets the
// compiler assume no float is infinite.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask) {
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

#ifdef CONVEYOR_AMX
// Encoder (bidirectional) attention over packed sequences with AMX, for bfloat16 and head_dim 32. Per sequence:
// one pass down its rows packs every head's Q, K and V into AMX's tile layouts; then per head, 32 query rows at a
// time as two 16-row tiles sharing every K and V tile: S = Q K^T in float32, softmax in float32 with P rounded to
// bf16 (as torch's flash attention rounds it), O = P V, divided by the row sums and rounded once.

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct SequenceBuffers {
  std::vector<uint16_t> queries;           // [heads, rows rounded up to 32, 32] bf16
  std::vector<uint32_t> k_tiles, v_tiles;  // [heads, blocks, 256] packed K^T and V tiles, 1 KiB each
  std::vector<float> scores;               // [32, keys rounded up to 16]
  std::vector<uint16_t> probs;             // [32, keys rounded up to 32] bf16
  uint32_t keys[16 * 256];                 // one block's 16 key rows per head (at most 16 heads), as loaded
  float out[32 * 32];
};

// One pass down the sequence's rows (so the hardware prefetcher streams them): every head's Q rows, K^T tiles
// and V tiles into the buffers. K^T tile b: row w holds dim pair w (a 32-bit word) of keys 16b..16b+15. V tiles of
// block b, dims 0-15 then 16-31: row i holds keys 32b+2i and 32b+2i+1, interleaved per dim. Zero past the sequence.
static void pack_sequence(const uint16_t* first, int64_t row_stride, int64_t length, int64_t heads,
                          SequenceBuffers& buf) {
  const int64_t hidden = heads * 32, kblocks = (length + 15) / 16, vblocks = (length + 31) / 32;
  const int64_t qrows = vblocks * 32;
  buf.queries.resize(heads * qrows * 32);
  buf.k_tiles.resize(heads * kblocks * 256);
  buf.v_tiles.resize(heads * vblocks * 512);
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int64_t b = 0; b < vblocks * 2; ++b) {  // 16 rows at a time
    for (int64_t n = 0; n < 16; n += 2) {
      const int64_t j = b * 16 + n;
      const uint16_t* row0 = first + j * row_stride;
      const uint16_t* row1 = row0 + row_stride;
      for (int64_t h = 0; h < heads; ++h) {
        const __m512i zero = _mm512_setzero_si512();
        _mm512_storeu_si512(&buf.queries[(h * qrows + j) * 32], j < length ? _mm512_loadu_si512(row0 + h * 32) : zero);
        _mm512_storeu_si512(&buf.queries[(h * qrows + j + 1) * 32],
                            j + 1 < length ? _mm512_loadu_si512(row1 + h * 32) : zero);
        _mm512_storeu_si512(&buf.keys[h * 256 + n * 16],
                            j < length ? _mm512_loadu_si512(row0 + hidden + h * 32) : zero);
        _mm512_storeu_si512(&buf.keys[h * 256 + (n + 1) * 16],
                            j + 1 < length ? _mm512_loadu_si512(row1 + hidden + h * 32) : zero);
        for (int64_t half = 0; half < 2; ++half) {
          const auto value_dims = [&](const uint16_t* row, int64_t key) {  // 16 dims widened to 32 bits
            return key < length ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(row + 2 * hidden + h * 32 + half * 16)))
                                : zero;
          };
          _mm512_storeu_si512(&buf.v_tiles[(h * vblocks + j / 32) * 512 + half * 256 + (j % 32) / 2 * 16],
                              _mm512_or_si512(value_dims(row0, j), _mm512_slli_epi32(value_dims(row1, j + 1), 16)));
        }
      }
    }
    if (b < kblocks)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t w = 0; w < 16; ++w)
          _mm512_storeu_si512(&buf.k_tiles[(h * kblocks + b) * 256 + w * 16],
                              _mm512_i32gather_epi32(column, &buf.keys[h * 256 + w], 4));
  }
}

static void attend_head(const uint16_t* queries, const uint32_t* k_tiles, const uint32_t* v_tiles, int64_t length,
                        float scale, uint16_t* out, int64_t out_stride, SequenceBuffers& buf) {
  const int64_t kblocks = (length + 15) / 16, vblocks = (length + 31) / 32;
  const int64_t sstride = kblocks * 16, pstride = vblocks * 32;
  buf.scores.resize(32 * sstride);
  buf.probs.resize(32 * pstride);
  // exp((s - max) * scale) as 2^(s * scale * log2(e) - max * scale * log2(e))
  const float log2_scale = scale * 1.44269504088896341f;
  const __m512 vscale = _mm512_set1_ps(log2_scale);
  for (int64_t q0 = 0; q0 < length; q0 += 32) {
    const int64_t rows = std::min<int64_t>(32, length - q0);
    const bool second = rows > 16;
    _tile_loadd(2, queries + q0 * 32, 64);
    if (second) _tile_loadd(5, queries + (q0 + 16) * 32, 64);
    for (int64_t b = 0; b < kblocks; ++b) {
      _tile_zero(0);
      _tile_loadd(3, &k_tiles[b * 256], 64);
      _tile_dpbf16ps(0, 2, 3);
      if (second) {
        _tile_zero(1);
        _tile_dpbf16ps(1, 5, 3);
      }
      _tile_stored(0, &buf.scores[b * 16], sstride * 4);
      if (second) _tile_stored(1, &buf.scores[16 * sstride + b * 16], sstride * 4);
    }
    float sums[32];
    for (int64_t r = 0; r < (second ? 32 : 16); ++r) {
      uint16_t* pr = &buf.probs[r * pstride];
      if (r >= rows) {  // rows past the sequence: zero probabilities, outputs never written
        std::memset(pr, 0, pstride * 2);
        continue;
      }
      const float* sr = &buf.scores[r * sstride];
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::max());
      for (int64_t j = 0; j < sstride; j += 16)
        vmax = _mm512_mask_max_ps(vmax, first_lanes(length - j), vmax, _mm512_loadu_ps(sr + j));
      const __m512 shift = _mm512_set1_ps(-_mm512_reduce_max_ps(vmax) * log2_scale);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t j = 0; j < sstride; j += 16) {
        const __m512 e = _mm512_maskz_mov_ps(first_lanes(length - j),
                                             exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(sr + j), vscale, shift)));
        vsum = _mm512_add_ps(vsum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
      }
      if (pstride > sstride) std::memset(pr + sstride, 0, (pstride - sstride) * 2);
      sums[r] = _mm512_reduce_add_ps(vsum);
    }
    _tile_zero(0);
    _tile_zero(1);
    if (second) {
      _tile_zero(6);
      _tile_zero(7);
    }
    for (int64_t b = 0; b < vblocks; ++b) {
      _tile_loadd(2, &buf.probs[b * 32], pstride * 2);
      _tile_loadd(3, &v_tiles[b * 512], 64);
      _tile_loadd(4, &v_tiles[b * 512 + 256], 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
      if (second) {
        _tile_loadd(5, &buf.probs[16 * pstride + b * 32], pstride * 2);
        _tile_dpbf16ps(6, 5, 3);
        _tile_dpbf16ps(7, 5, 4);
      }
    }
    _tile_stored(0, buf.out, 128);
    _tile_stored(1, buf.out + 16, 128);
    if (second) {
      _tile_stored(6, buf.out + 16 * 32, 128);
      _tile_stored(7, buf.out + 16 * 32 + 16, 128);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(buf.out + r * 32), inv);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(buf.out + r * 32 + 16), inv);
      _mm512_storeu_si512(out + (q0 + r) * out_stride, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// LayerNorm of bf16 rows (a multiple of 16 wide, at most 1024): each row read once into float32, statistics and
// the affine map in float32, rounded once. torch's bf16 kernel takes 1.7x as long (8192 x 384, one thread).
static void layer_norm_rows(const uint16_t* x, const uint16_t* weight, const uint16_t* bias, uint16_t* out,
                            int64_t rows, int64_t size, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    alignas(64) float h[1024], w[1024], b[1024];
    for (int64_t i = 0; i < size; i += 16) {
      _mm512_store_ps(w + i, load_bf16(weight + i));
      _mm512_store_ps(b + i, load_bf16(bias + i));
    }
    const float inv_size = 1.f / static_cast<float>(size);
    for (int64_t r = begin; r < end; ++r) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < size; i += 16) {
        const __m512 v = load_bf16(x + r * size + i);
        _mm512_store_ps(h + i, v);
        sum = _mm512_add_ps(sum, v);
      }
      const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(sum) * inv_size);
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < size; i += 16) {
        const __m512 d = _mm512_sub_ps(_mm512_load_ps(h + i), mean);
        squares = _mm512_fmadd_ps(d, d, squares);
      }
      const __m512 inv_std = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) * inv_size + eps));
      for (int64_t i = 0; i < size; i += 16) {
        const __m512 normed = _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(h + i), mean), inv_std);
        const __m512 y = _mm512_fmadd_ps(normed, _mm512_load_ps(w + i), _mm512_load_ps(b + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * size + i), (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
  });
}

// Linux lends AMX's tile registers to a process only on request.
static bool amx_permitted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return permitted;
}
#endif

bool encoder_kernels_available() {
#ifdef CONVEYOR_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// qkv: [rows, 3 * heads * 32] bf16, q then k then v, sequences end to end from row 0 as seq_starts ([B + 1]
// int64) bounds them. Returns [rows, heads * 32]; rows past the last sequence are zero.
torch::Tensor encoder_attention(torch::Tensor qkv, torch::Tensor seq_starts, int64_t num_heads, double scale) {
  TORCH_CHECK(encoder_kernels_available(), "encoder_attention needs AMX (bf16) and a kernel built with it");
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kBFloat16 && qkv.stride(1) == 1, "bf16 [rows, 3 * hidden]");
  TORCH_CHECK(qkv.size(1) == 3 * num_heads * 32 && num_heads <= 16, "head_dim must be 32, heads at most 16");
  TORCH_CHECK(seq_starts.scalar_type() == torch::kInt64 && seq_starts.is_contiguous(), "int64 seq_starts");
  const int64_t hidden = num_heads * 32, num_seqs = seq_starts.size(0) - 1;
  const int64_t* starts = seq_starts.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] <= qkv.size(0), "sequences must lie end to end from row 0");
  auto out = torch::empty({qkv.size(0), hidden}, qkv.options());
  out.narrow(0, starts[num_seqs], qkv.size(0) - starts[num_seqs]).zero_();
#ifdef CONVEYOR_AMX
  const auto* rows = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>());
  auto* out_rows = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t row_stride = qkv.stride(0);
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
    SequenceBuffers buf;
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t length = starts[seq + 1] - starts[seq];
      const int64_t kblocks = (length + 15) / 16, vblocks = (length + 31) / 32;
      pack_sequence(rows + starts[seq] * row_stride, row_stride, length, num_heads, buf);
      for (int64_t h = 0; h < num_heads; ++h)
        attend_head(&buf.queries[h * vblocks * 32 * 32], &buf.k_tiles[h * kblocks * 256],
                    &buf.v_tiles[h * vblocks * 512], length, static_cast<float>(scale),
                    out_rows + starts[seq] * hidden + h * 32, hidden, buf);
    }
    _tile_release();
  });
#endif
  return out;
}

// LayerNorm over the last dimension of bf16 x with bf16 weight and bias; at most 1024 wide, a multiple of 16.
torch::Tensor layer_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps) {
  TORCH_CHECK(encoder_kernels_available(), "layer_norm needs AVX-512 BF16 and a kernel built with it");
  const int64_t size = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && bias.is_contiguous(), "contiguous inputs only");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16 &&
                  bias.scalar_type() == torch::kBFloat16, "layer_norm takes bf16 only");
  TORCH_CHECK(size % 16 == 0 && size <= 1024 && weight.numel() == size && bias.numel() == size, "bad width");
  auto out = torch::empty_like(x);
#ifdef CONVEYOR_AMX
  layer_norm_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(bias.data_ptr<at::BFloat16>()),
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), x.numel() / size, size,
                  static_cast<float>(eps));
#endif
  return out;
}

#ifdef CONVEYOR_AVX512_BF16
// bf16 prefill attention with AVX-512 BF16, for chunks of several query rows per sequence (causal, after any cached
// prefix, optionally windowed). Two passes. First each sequence's attended keys are packed per kv head for
// dpbf16ps, which multiplies bf16 pairs: K transposed to [span of 64 keys][head_dim / 2][64] pairs (d, d + 1), so
// one broadcast query pair against one load gives 16 keys' partial scores with no horizontal sums; V to
// [key pair][head_dim] pairs (t, t + 1), against which the bf16-rounded probabilities of two keys, broadcast as
// a pair, accumulate head_dim / 16 output registers per instruction (torch's bf16 flash attention rounds the
// probabilities the same way). Then each task, a tile of one sequence's query rows for one kv head, runs its
// query heads kRows rows at a time through the spans their causal (and window) limits reach: scores of a whole
// span, one online-softmax update per row and span (in base 2), p.v. Packing once per sequence and kv head
// costs a pass over its K/V; every tile then reads the packed copy from cache.
constexpr int64_t kSpan = 64;  // keys per online-softmax update: four 16-lane score registers per row
constexpr int64_t kTileRows = 32;  // query rows per task

struct PackedSequence {
  int64_t first_query;  // position of the chunk's first query row
  int64_t lowest_key;  // the first key any of its rows attends (0 without a window)
  int64_t key_base;  // lowest_key rounded down to a span: spans are counted from here
  int64_t num_spans;
  int64_t offset;  // where its spans start in the packed buffers, in uint32 pairs, per kv head
};

// One head's cache row as bf16 bits: a bf16 row as it is; an int8 row (kernels/kv_quant.py) dequantized, value x its
// float32 scale rounded to bf16 (nearest even), exactly what kv_quant.dequantize(rows, torch.bfloat16) gives.
static inline void bf16_row(const uint16_t* row, int64_t dim, uint16_t* dst) { std::memcpy(dst, row, 2 * dim); }

static inline void bf16_row(const int8_t* row, int64_t dim, uint16_t* dst) {
  float scale;
  std::memcpy(&scale, row + dim, sizeof(float));  // unaligned: rows are dim + 4 bytes apart
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < dim; d += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
    store_bf16(dst + d, round_bf16(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scales)));
  }
}

// cache_t: uint16_t (bf16 bits) or int8_t, whose rows are dim + 4 wide (row_width).
template <typename cache_t>
static void pack_keys_and_values(const cache_t* k_cache, const cache_t* v_cache, const int32_t* table,
                                 int64_t block_size, int64_t slot_stride, int64_t kv, int64_t dim, int64_t row_width,
                                 int64_t length, const PackedSequence& seq, uint32_t* k_packed, uint32_t* v_packed) {
  const int64_t pairs = dim / 2;
  alignas(64) uint16_t k_row[256], v_row[256];  // dim <= 256
  for (int64_t i = 0; i < seq.num_spans * kSpan; ++i) {
    const int64_t pos = seq.key_base + i;
    uint32_t* k_dst = k_packed + (i / kSpan) * pairs * kSpan + i % kSpan;
    uint16_t* v_dst = reinterpret_cast<uint16_t*>(v_packed + (i / 2) * dim) + (i & 1);
    // Keys outside the attended range are zero (masked later; zero keeps 0 * value finite). Blocks before the
    // window may already be freed and are never read.
    if (pos < seq.lowest_key || pos >= length) {
      for (int64_t p = 0; p < pairs; ++p) k_dst[p * kSpan] = 0;
      for (int64_t d = 0; d < dim; ++d) v_dst[2 * d] = 0;
      continue;
    }
    const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
    bf16_row(k_cache + slot * slot_stride + kv * row_width, dim, k_row);
    bf16_row(v_cache + slot * slot_stride + kv * row_width, dim, v_row);
    const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(k_row);
    for (int64_t p = 0; p < pairs; ++p) k_dst[p * kSpan] = k_pairs[p];
    for (int64_t d = 0; d < dim; ++d) v_dst[2 * d] = v_row[d];
  }
}

// Query rows [first_row, first_row + rows) of one head, at positions first_pos.., rows <= kRows, against one
// sequence's packed keys of the head's kv head. `query`/`out` point at the head's first row.
template <int kChunks, int kRows>
static void attend_prefill_rows(const uint16_t* query, int64_t query_row_stride, uint16_t* out, int64_t out_row_stride,
                                int64_t rows, int64_t first_pos, const uint32_t* k_packed, const uint32_t* v_packed,
                                const PackedSequence& seq, int64_t window, float scale) {
  constexpr int64_t kDim = 32 * kChunks, kPairs = kDim / 2, kLanes = kDim / 16;
  const int64_t last_pos = first_pos + rows - 1;
  const int64_t lowest = window > 0 ? std::max<int64_t>(seq.lowest_key, first_pos - window + 1) : 0;
  const uint32_t* q[kRows];
  for (int r = 0; r < kRows; ++r)  // missing rows repeat the last one: computed, never stored
    q[r] = reinterpret_cast<const uint32_t*>(query + std::min<int64_t>(r, rows - 1) * query_row_stride);
  alignas(64) float acc[kRows][kDim] = {};
  alignas(64) uint32_t probs[kRows][kSpan / 2];
  float running_max[kRows], running_sum[kRows] = {};
  std::fill(running_max, running_max + kRows, kNoScore);
  const __m512 log2_scale = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t s = (lowest - seq.key_base) / kSpan; s <= (last_pos - seq.key_base) / kSpan; ++s) {
    const int64_t span_first = seq.key_base + s * kSpan;
    const int64_t groups = std::min<int64_t>(4, (last_pos - span_first) / 16 + 1);  // 16-key groups any row reaches
    __m512 score[kRows][4];
    for (int r = 0; r < kRows; ++r)
      for (int g = 0; g < 4; ++g) score[r][g] = _mm512_setzero_ps();
    const uint32_t* k_span = k_packed + s * kPairs * kSpan;
    for (int64_t p = 0; p < kPairs; ++p) {
      for (int g = 0; g < groups; ++g) {
        const __m512bh key = (__m512bh)_mm512_loadu_si512(k_span + p * kSpan + 16 * g);
        for (int r = 0; r < kRows; ++r)
          score[r][g] = _mm512_dpbf16_ps(score[r][g], (__m512bh)_mm512_set1_epi32(q[r][p]), key);
      }
    }
    // Whether every row attends every key of the span: the last row's window starts latest, the first row ends first.
    const bool whole = (window <= 0 || span_first >= last_pos - window + 1) && span_first + kSpan - 1 <= first_pos;
    for (int r = 0; r < kRows; ++r) {
      const int64_t pos = first_pos + std::min<int64_t>(r, rows - 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(seq.lowest_key, pos - window + 1) : 0;
      __mmask16 attended[4];
      __m512 x[4];
      __m512 span_max = _mm512_set1_ps(kNoScore);
      for (int g = 0; g < 4; ++g) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(span_first - lo + 16 * g)));
        // keys lo..pos are attended: key - lo in [0, pos - lo]
        attended[g] = g >= groups ? 0
                      : whole    ? 0xffff
                                 : _mm512_cmp_epu32_mask(key, _mm512_set1_epi32(static_cast<int>(pos - lo)), _MM_CMPINT_LE);
        x[g] = _mm512_maskz_mul_ps(attended[g], score[r][g], log2_scale);
        span_max = _mm512_mask_max_ps(span_max, attended[g], span_max, x[g]);
      }
      if (!(attended[0] | attended[1] | attended[2] | attended[3])) {
        std::fill(probs[r], probs[r] + kSpan / 2, 0u);
        continue;
      }
      const float new_max = std::max(running_max[r], _mm512_reduce_max_ps(span_max));
      const float correction = std::exp2(running_max[r] - new_max);
      running_max[r] = new_max;
      __m512 sum = _mm512_setzero_ps();
      for (int g = 0; g < 4; ++g) {
        x[g] = _mm512_maskz_mov_ps(attended[g], exp2_ps(_mm512_sub_ps(x[g], _mm512_set1_ps(new_max))));
        sum = _mm512_add_ps(sum, x[g]);
      }
      running_sum[r] = running_sum[r] * correction + _mm512_reduce_add_ps(sum);
      _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
      _mm512_store_si512(probs[r] + 16, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
      if (correction != 1.f)
        for (int c = 0; c < kLanes; ++c)
          _mm512_store_ps(acc[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), _mm512_set1_ps(correction)));
    }
    __m512 o[kRows][kLanes];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kLanes; ++c) o[r][c] = _mm512_load_ps(acc[r] + 16 * c);
    const uint32_t* v_span = v_packed + s * (kSpan / 2) * kDim;
    for (int64_t kp = 0; kp < std::min<int64_t>(kSpan / 2, (last_pos - span_first) / 2 + 1); ++kp) {
      __m512i p[kRows];
      for (int r = 0; r < kRows; ++r) p[r] = _mm512_set1_epi32(probs[r][kp]);
      for (int c = 0; c < kLanes; ++c) {
        const __m512bh value = (__m512bh)_mm512_loadu_si512(v_span + kp * kDim + 16 * c);
        for (int r = 0; r < kRows; ++r) o[r][c] = _mm512_dpbf16_ps(o[r][c], (__m512bh)p[r], value);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kLanes; ++c) _mm512_store_ps(acc[r] + 16 * c, o[r][c]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(running_sum[r] > 0.f ? 1.f / running_sum[r] : 0.f);
    uint16_t* dst = out + r * out_row_stride;
    for (int c = 0; c < kChunks; ++c) {
      const __m512 lo = _mm512_mul_ps(_mm512_load_ps(acc[r] + 32 * c), inv);
      const __m512 hi = _mm512_mul_ps(_mm512_load_ps(acc[r] + 32 * c + 16), inv);
      _mm512_storeu_si512(dst + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

template <int kChunks, typename cache_t>
static void prefill_attention_bf16(const uint16_t* query, int64_t query_row_stride, int64_t query_head_stride,
                                   const cache_t* k_cache, const cache_t* v_cache, const int32_t* block_tables,
                                   int64_t max_blocks, const int32_t* seq_lens, const int64_t* query_starts,
                                   const int64_t* query_ends, uint16_t* out, int64_t out_row_stride, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t block_size, float scale, int64_t window) {
  constexpr int64_t kDim = 32 * kChunks;
  constexpr int kRows = kChunks >= 8 ? 1 : kChunks >= 4 ? 2 : 4;  // output registers: kRows * kDim / 16 <= 16
  // An int8 cache's rows carry their scale after the values (kernels/kv_quant.py).
  const int64_t row_width = std::is_same_v<cache_t, int8_t> ? kDim + 4 : kDim;
  const int64_t group = num_heads / num_kv_heads, slot_stride = num_kv_heads * row_width;
  std::vector<PackedSequence> seqs(num_seqs);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, first query row of the tile within it)
  int64_t packed_pairs = 0;  // per kv head
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = query_ends[i] - query_starts[i], first_query = seq_lens[i] - q_len;
    const int64_t lowest = window > 0 ? std::max<int64_t>(0, first_query - window + 1) : 0;
    const int64_t base = lowest / kSpan * kSpan;
    seqs[i] = {first_query, lowest, base, (seq_lens[i] - base + kSpan - 1) / kSpan, packed_pairs};
    packed_pairs += seqs[i].num_spans * kSpan * kDim / 2;
    for (int64_t row = 0; row < q_len; row += kTileRows) tiles.emplace_back(i, row);
  }
  std::vector<uint32_t> k_packed(packed_pairs * num_kv_heads), v_packed(packed_pairs * num_kv_heads);
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / num_kv_heads, kv = task % num_kv_heads;
      const int64_t at = kv * packed_pairs + seqs[i].offset;
      pack_keys_and_values(k_cache, v_cache, block_tables + i * max_blocks, block_size, slot_stride, kv, kDim,
                           row_width, seq_lens[i], seqs[i], k_packed.data() + at, v_packed.data() + at);
    }
  });
  // Tiles attend contexts of very different lengths: handed out one at a time, longest first.
  std::sort(tiles.begin(), tiles.end(), [&](const auto& a, const auto& b) {
    return seqs[a.first].first_query + a.second > seqs[b.first].first_query + b.second;
  });
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t task = next++; task < num_tasks; task = next++) {
      const auto [i, tile_row] = tiles[task / num_kv_heads];
      const int64_t kv = task % num_kv_heads;
      const PackedSequence& seq = seqs[i];
      const int64_t at = kv * packed_pairs + seq.offset;
      const int64_t tile_end = std::min<int64_t>(tile_row + kTileRows, query_ends[i] - query_starts[i]);
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        for (int64_t row = tile_row; row < tile_end; row += kRows) {
          const int64_t token = query_starts[i] + row;
          attend_prefill_rows<kChunks, kRows>(
              query + token * query_row_stride + h * query_head_stride, query_row_stride,
              out + token * out_row_stride + h * kDim, out_row_stride, std::min<int64_t>(kRows, tile_end - row),
              seq.first_query + row, k_packed.data() + at, v_packed.data() + at, seq, window, scale);
        }
      }
    }
  });
}
#endif

bool prefill_attention_available(int64_t head_dim) {
#ifdef CONVEYOR_AVX512_BF16
  return head_dim % 32 == 0 && head_dim / 32 <= 8 && ((head_dim / 32) & (head_dim / 32 - 1)) == 0;
#else
  return false;
#endif
}

// Causal attention of each sequence's query rows query_starts[i]..query_ends[i] (its newest tokens, whose K/V are
// already in the cache) over its context of seq_lens[i] tokens, read through its block table; rows of other
// sequences in `out` are left alone.
void paged_prefill_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_starts,
                             torch::Tensor query_ends, torch::Tensor out, double scale, int64_t window) {
  // An int8 cache (kernels/kv_quant.py) is read as its rows dequantized to bf16 when they are packed.
  const bool int8 = k_cache.scalar_type() == at::kChar;
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(prefill_attention_available(head_dim), "no bf16 prefill kernel for this CPU or head_dim");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  (k_cache.scalar_type() == at::kBFloat16 || int8) && v_cache.scalar_type() == k_cache.scalar_type(),
              "bf16 queries; bf16 or int8 caches");
  TORCH_CHECK(k_cache.size(3) == (int8 ? head_dim + 4 : head_dim), "a cache row is head_dim (int8: + 4) wide");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.stride(1) == out.size(2), "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(query_starts.scalar_type() == torch::kInt64 && query_ends.scalar_type() == torch::kInt64 &&
                  query_starts.numel() == seq_lens.numel() && query_ends.numel() == seq_lens.numel(), "int64 query rows");
#ifdef CONVEYOR_AVX512_BF16
  const auto run = [&](auto chunks, const auto* k, const auto* v) {
    prefill_attention_bf16<decltype(chunks)::value>(
        reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>()), query.stride(0), query.stride(1), k, v,
        block_tables.data_ptr<int32_t>(), block_tables.size(1), seq_lens.data_ptr<int32_t>(),
        query_starts.data_ptr<int64_t>(), query_ends.data_ptr<int64_t>(),
        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out.stride(0),
        seq_lens.size(0), query.size(1), k_cache.size(2), k_cache.size(1), static_cast<float>(scale), window);
  };
  const auto for_cache = [&](auto chunks) {
    if (int8)
      run(chunks, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    else
      run(chunks, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
          reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
  };
  switch (head_dim / 32) {
    case 1: for_cache(std::integral_constant<int, 1>{}); return;
    case 2: for_cache(std::integral_constant<int, 2>{}); return;
    case 4: for_cache(std::integral_constant<int, 4>{}); return;
    default: for_cache(std::integral_constant<int, 8>{}); return;
  }
#endif
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
std::tuple<torch::Tensor, torch::Tensor> greedy_sample(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "greedy_sample needs [rows, vocab] with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, "float32 or bf16 logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto tokens = torch::empty({rows}, torch::kInt64);
  auto logprobs = torch::empty({rows}, torch::kFloat);
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
