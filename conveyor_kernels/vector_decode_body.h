// The body of the CPU's vector decode attention over int8 and float32 caches, compiled once per instruction set,
// each in its own file (vector_decode_avx512.cpp, vector_decode_avx2.cpp), which includes it inside
// `namespace vector_decode::isa_<name>` under `#pragma GCC target(...)` after defining that set's `vec` (W float
// lanes) and its helpers: load / store / set1 / fmadd / mul / add / sub / max, load_int8 (W int8 values widened to
// float, exactly), reduce_max / reduce_add, exp2 and sum_lanes (W vectors -> one whose lane i is the sum of vector
// i). It exports its set's `decode_kernels` (vector_decode.h).
//
// The shape of cpu_decode_attention.cpp's decode_kernel_bf16: a task is one sequence (handed out one at a time: lengths
// differ), taken a span of kSpan positions at a time (a span may cross blocks: each position's row is found through
// the block table), all its kv heads per span, each kv head's work prefetching the next one's rows (the next span's
// after the last kv head; the following sequence's first after its last span), since blocks lie anywhere in the
// cache and the hardware prefetcher would start over at each. Per kv head and span, an int8 cache's K and V rows are
// widened once to float (their int8 values, exactly) into L1 buffers, and each row's float32 scale is set aside; a
// float32 cache's rows are read where they lie. All the kv head's query heads then read them (GQA). Per query head
// and span:
//  - q.k: W positions at a time, float32 dot products of the query (times `scale`) with the rows, summed together by
//    sum_lanes; for an int8 cache, then times each row's K scale: score = (q . k_int8) x s_k, the dequantized row's
//    dot product (int8 x float32 scale) up to float32 rounding order;
//  - one online-softmax step for the whole span in float32 (one max, one correction, exp2 of the log2e-scaled
//    scores), the probabilities summed unrounded;
//  - p.v: each probability (for an int8 cache, times its row's V scale) multiply-added with the row into float32
//    accumulators: sum_t p_t x v_t, with an int8 cache sum_t p_t x s_v,t x v_int8,t, the dequantized values' sum.
// Everything after the read is float32 (no bf16 rounding of the probabilities), so a float32 model meets the float32
// reference as the portable kernel does, and a bf16 model's output is the float32 result rounded once.

// kDim: head_dim (a multiple of W); q_t: float, or uint16_t holding bf16 bits; cache_t: int8_t or float.
template <int64_t kDim, typename q_t, typename cache_t>
void decode(const q_t* query, int64_t query_row_stride, int64_t query_head_stride, const cache_t* k_cache,
            const cache_t* v_cache, const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
            const int64_t* token_index, q_t* out, int64_t out_row_stride, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t block_size, float scale, int64_t window, float softcap) {
  constexpr int64_t kVecs = kDim / W;
  constexpr bool kInt8 = std::is_same_v<cache_t, int8_t>;
  constexpr int64_t kRow = kInt8 ? kDim + 4 : kDim;  // an int8 row: the values, then their float32 scale
  constexpr int64_t kRowBytes = kRow * static_cast<int64_t>(sizeof(cache_t));
  // Positions per softmax step: a span's K and V rows (widened, or a float32 cache's own: 2 x kSpan x kDim floats,
  // 16 KiB) stay within L1 while the group's query heads read them (float32 spans of 64 and 128 measured slower).
  constexpr int64_t kSpan = kDim >= 128 ? 16 : 2048 / kDim, kPieces = kSpan / W;
  // p.v: accumulators for at most kPart vectors of a row at a time (the registers: 32 zmm, 16 ymm), in kSets
  // independent chains so that about 8 multiply-adds are in flight.
  constexpr int64_t kPart = kVecs < 2 * W ? kVecs : 2 * W == 32 ? 16 : 8;
  constexpr int64_t kSets = kPart >= 8 ? 1 : 8 / kPart;
  static_assert(kSpan % W == 0 && kVecs % kPart == 0, "spans of whole vectors");
  const int64_t group = num_heads / num_kv_heads, slot_stride = num_kv_heads * kRow;
  const vec log2e = set1(1.44269504088896341f);
  std::atomic<int64_t> next_seq{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> acc(num_heads * kDim), q(num_heads * kDim), running_max(num_heads), running_sum(num_heads);
    alignas(64) float keys[kInt8 ? kSpan * kDim : 1], values[kInt8 ? kSpan * kDim : 1], zero_row[kDim] = {};
    alignas(64) float k_scale[kSpan] = {}, v_scale[kSpan] = {}, s[kSpan] = {}, p[kSpan] = {};
    // The span's rows as floats: the widened int8 rows, or the float32 cache's own; past the span's end, zeros.
    const float* key_rows[kSpan];
    const float* value_rows[kSpan];
    int64_t rows[2][kSpan];  // this span's and the next one's rows: offsets into the caches
    const auto first_position = [&](int64_t seq) { return paged_rows::first_position(seq_lens[seq], window); };
    const auto locate = [&](int64_t seq, int64_t begin, int64_t* span_rows) {
      return paged_rows::locate(block_tables + seq * max_blocks, block_size, slot_stride, seq_lens[seq], begin, kSpan,
                                span_rows);
    };
    int64_t span = 0;
    for (int64_t seq = next_seq++, following; seq < num_seqs; seq = following) {
      following = next_seq++;
      const int64_t length = seq_lens[seq], row = token_index[seq];
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(running_max.begin(), running_max.end(), kNoScore);
      std::fill(running_sum.begin(), running_sum.end(), 0.f);
      for (int64_t h = 0; h < num_heads; ++h) {
        const q_t* src = query + row * query_row_stride + h * query_head_stride;
        for (int64_t d = 0; d < kDim; ++d) q[h * kDim + d] = to_float(src[d]) * scale;
      }
      locate(seq, first_position(seq), rows[span]);
      for (int64_t start = first_position(seq); start < length; start += kSpan, span ^= 1) {
        const int64_t n = std::min(kSpan, length - start);
        const int64_t* span_rows = rows[span];
        const int64_t next_n = start + kSpan < length ? locate(seq, start + kSpan, rows[span ^ 1])
                               : following < num_seqs ? locate(following, first_position(following), rows[span ^ 1])
                                                      : 0;
        for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
          // The next kv head's rows go to L2 a few at a time, spread over this kv head's work (its widening, then
          // each query head): in one burst they would stall the loads that need the data now.
          const bool last_head = kv + 1 == num_kv_heads;
          const int64_t* ahead_rows = last_head ? rows[span ^ 1] : span_rows;
          const int64_t ahead_n = last_head ? next_n : n, ahead_head = (last_head ? 0 : kv + 1) * kRow;
          const int64_t steps = group + 1;
          int64_t ahead_t = 0;
          const auto prefetch_step = [&](int64_t step) __attribute__((always_inline)) {
            for (const int64_t upto = (step + 1) * ahead_n / steps; ahead_t < upto; ++ahead_t) {
              const char* k_at = reinterpret_cast<const char*>(k_cache + ahead_rows[ahead_t] + ahead_head);
              const char* v_at = reinterpret_cast<const char*>(v_cache + ahead_rows[ahead_t] + ahead_head);
              for (int64_t byte = 0; byte < kRowBytes; byte += 64) {
                __builtin_prefetch(k_at + byte, 0, 2);
                __builtin_prefetch(v_at + byte, 0, 2);
              }
              if constexpr (kRowBytes % 64 != 0) {  // the row's end (an int8 row's scale) on another line
                __builtin_prefetch(k_at + kRowBytes - 1, 0, 2);
                __builtin_prefetch(v_at + kRowBytes - 1, 0, 2);
              }
            }
          };
          prefetch_step(0);
          for (int64_t t = 0; t < n; ++t) {
            const cache_t* k_row = k_cache + span_rows[t] + kv * kRow;
            const cache_t* v_row = v_cache + span_rows[t] + kv * kRow;
            if constexpr (kInt8) {
              for (int64_t c = 0; c < kVecs; ++c) {
                store(keys + t * kDim + W * c, load_int8(k_row + W * c));
                store(values + t * kDim + W * c, load_int8(v_row + W * c));
              }
              std::memcpy(&k_scale[t], k_row + kDim, sizeof(float));  // unaligned: rows are kDim + 4 bytes apart
              std::memcpy(&v_scale[t], v_row + kDim, sizeof(float));
              key_rows[t] = keys + t * kDim, value_rows[t] = values + t * kDim;
            } else {
              key_rows[t] = k_row, value_rows[t] = v_row;
            }
          }
          // The last vector's positions past the span's end: zero keys (their scores are then set aside below).
          for (int64_t t = n; t < (n + W - 1) / W * W; ++t) key_rows[t] = zero_row;
          for (int64_t j = 0; j < group; ++j) {
            const int64_t h = kv * group + j;
            prefetch_step(j + 1);
            const float* qh = &q[h * kDim];
            for (int64_t piece = 0; piece * W < n; ++piece) {
              vec partial[W];
              for (int64_t t = 0; t < W; ++t) {
                const float* key = key_rows[piece * W + t];
                vec dot = mul(load(qh), load(key));
                for (int64_t c = 1; c < kVecs; ++c) dot = fmadd(load(qh + W * c), load(key + W * c), dot);
                partial[t] = dot;
              }
              const vec dots = sum_lanes(partial);
              store(s + piece * W, kInt8 ? mul(dots, load(k_scale + piece * W)) : dots);
            }
            if (softcap > 0.f)
              for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
            for (int64_t t = n; t < (n + W - 1) / W * W; ++t) s[t] = kNoScore;  // past the span's last position
            vec top = set1(kNoScore);
            for (int64_t piece = 0; piece * W < n; ++piece) top = max(top, load(s + piece * W));
            const float new_max = std::max(running_max[h], reduce_max(top) * 1.44269504088896341f);  // log2 units
            const float correction = std::exp2(running_max[h] - new_max);
            running_max[h] = new_max;
            vec total = set1(0.f);
            for (int64_t piece = 0; piece * W < n; ++piece) {
              const vec e = exp2(sub(mul(load(s + piece * W), log2e), set1(new_max)));
              store(p + piece * W, e);
            }
            for (int64_t t = n; t < (n + W - 1) / W * W; ++t) p[t] = 0.f;  // past the span's last position
            for (int64_t piece = 0; piece * W < n; ++piece) {
              const vec e = load(p + piece * W);
              total = add(total, e);
              if constexpr (kInt8) store(p + piece * W, mul(e, load(v_scale + piece * W)));  // the int8 values' weight
            }
            running_sum[h] = running_sum[h] * correction + reduce_add(total);
            float* ah = &acc[h * kDim];
            for (int64_t part = 0; part < kVecs; part += kPart) {
              vec o[kSets][kPart];
              for (int64_t c = 0; c < kPart; ++c) {
                o[0][c] = mul(load(ah + W * (part + c)), set1(correction));
                for (int64_t set = 1; set < kSets; ++set) o[set][c] = set1(0.f);
              }
              int64_t t = 0;
              for (; t + kSets <= n; t += kSets) {
                for (int64_t set = 0; set < kSets; ++set) {
                  const vec weight = set1(p[t + set]);
                  const float* value = value_rows[t + set] + W * part;
                  for (int64_t c = 0; c < kPart; ++c) o[set][c] = fmadd(weight, load(value + W * c), o[set][c]);
                }
              }
              for (; t < n; ++t) {
                const vec weight = set1(p[t]);
                const float* value = value_rows[t] + W * part;
                for (int64_t c = 0; c < kPart; ++c) o[0][c] = fmadd(weight, load(value + W * c), o[0][c]);
              }
              for (int64_t c = 0; c < kPart; ++c) {
                for (int64_t set = 1; set < kSets; ++set) o[0][c] = add(o[0][c], o[set][c]);
                store(ah + W * (part + c), o[0][c]);
              }
            }
          }
          prefetch_step(steps - 1);  // what a short span's steps left
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        q_t* dst = out + row * out_row_stride + h * kDim;
        const float inv = running_sum[h] > 0.f ? 1.f / running_sum[h] : 0.f;
        for (int64_t d = 0; d < kDim; ++d) dst[d] = from_float<q_t>(acc[h * kDim + d] * inv);
      }
    }
  });
}

// This instruction set's kernels, for vector_decode.cpp (vector_decode.h).
extern const DecodeKernels decode_kernels = {
    {&decode<kHeadDims[0], float, int8_t>, &decode<kHeadDims[1], float, int8_t>, &decode<kHeadDims[2], float, int8_t>,
     &decode<kHeadDims[3], float, int8_t>},
    {&decode<kHeadDims[0], uint16_t, int8_t>, &decode<kHeadDims[1], uint16_t, int8_t>,
     &decode<kHeadDims[2], uint16_t, int8_t>, &decode<kHeadDims[3], uint16_t, int8_t>},
    {&decode<kHeadDims[0], float, float>, &decode<kHeadDims[1], float, float>, &decode<kHeadDims[2], float, float>,
     &decode<kHeadDims[3], float, float>},
};
