// Paged prefill attention on the CPU: bf16 queries with AVX-512 BF16, straight from a bf16 or int8 paged cache.
#include "cpu_kernels.h"

#include <atomic>
#include <type_traits>
#include <utility>

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

// One head's cache row as bf16 bits: a bf16 row as it is; an int8 row (conveyor_kernels/kv_quant.py) dequantized, value x its
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
  // An int8 cache's rows carry their scale after the values (conveyor_kernels/kv_quant.py).
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
void paged_prefill_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                             at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_starts,
                             at::Tensor query_ends, at::Tensor out, double scale, int64_t window) {
  // An int8 cache (conveyor_kernels/kv_quant.py) is read as its rows dequantized to bf16 when they are packed.
  const bool int8 = k_cache.scalar_type() == at::kChar;
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(prefill_attention_available(head_dim), "no bf16 prefill kernel for this CPU or head_dim");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  (k_cache.scalar_type() == at::kBFloat16 || int8) && v_cache.scalar_type() == k_cache.scalar_type(),
              "bf16 queries; bf16 or int8 caches");
  TORCH_CHECK(k_cache.size(3) == (int8 ? head_dim + 4 : head_dim), "a cache row is head_dim (int8: + 4) wide");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.stride(1) == out.size(2), "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(query_starts.scalar_type() == at::kLong && query_ends.scalar_type() == at::kLong &&
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
