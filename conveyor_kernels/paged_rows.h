// Where a sequence's positions sit in a paged KV cache, for the CPU decode attention kernels (the bf16 one,
// cpu_decode_attention.cpp, and the int8 and float32 caches' body, vector_decode_body.h). Integer code only, included before
// any target pragma: one copy serves every instruction-set build.
#pragma once
#include <algorithm>
#include <cstdint>

namespace paged_rows {

// The first position a sequence of `seq_len` attends: 0, or under a sliding window its last `window` (the blocks
// before them may be freed: -1 in the table).
inline int64_t first_position(int64_t seq_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, seq_len - window) : int64_t{0};
}

// The cache offsets (in elements: rows `slot_stride` apart) of the sequence's positions from `begin`, up to `span` of
// them, into `rows`; returns their count. `table`: the sequence's block table.
inline int64_t locate(const int32_t* table, int64_t block_size, int64_t slot_stride, int64_t seq_len, int64_t begin,
                      int64_t span, int64_t* rows) {
  const int64_t count = std::min<int64_t>(span, seq_len - begin);
  for (int64_t t = 0, b = begin / block_size, slot = begin % block_size; t < count; ++t) {
    rows[t] = (table[b] * block_size + slot) * slot_stride;
    if (++slot == block_size) slot = 0, ++b;
  }
  return std::max<int64_t>(0, count);
}

}  // namespace paged_rows
