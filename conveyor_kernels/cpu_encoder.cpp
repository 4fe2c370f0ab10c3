// The embedding models' encoder kernels on the CPU: packed bidirectional attention on AMX tiles and a bf16
// LayerNorm, both where the build has AMX.
#include "cpu_kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <limits>

#include "isa_dispatch.h"  // amx_permitted

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

#endif

bool encoder_kernels_available() {
#ifdef CONVEYOR_AMX
  return isa_dispatch::amx_permitted();
#else
  return false;
#endif
}

// qkv: [rows, 3 * heads * 32] bf16, q then k then v, sequences end to end from row 0 as seq_starts ([B + 1]
// int64) bounds them. Returns [rows, heads * 32]; rows past the last sequence are zero.
at::Tensor encoder_attention(at::Tensor qkv, at::Tensor seq_starts, int64_t num_heads, double scale) {
  TORCH_CHECK(encoder_kernels_available(), "encoder_attention needs AMX (bf16) and a kernel built with it");
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 && qkv.stride(1) == 1, "bf16 [rows, 3 * hidden]");
  TORCH_CHECK(qkv.size(1) == 3 * num_heads * 32 && num_heads <= 16, "head_dim must be 32, heads at most 16");
  TORCH_CHECK(seq_starts.scalar_type() == at::kLong && seq_starts.is_contiguous(), "int64 seq_starts");
  const int64_t hidden = num_heads * 32, num_seqs = seq_starts.size(0) - 1;
  const int64_t* starts = seq_starts.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] <= qkv.size(0), "sequences must lie end to end from row 0");
  auto out = at::empty({qkv.size(0), hidden}, qkv.options());
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
at::Tensor layer_norm(at::Tensor x, at::Tensor weight, at::Tensor bias, double eps) {
  TORCH_CHECK(encoder_kernels_available(), "layer_norm needs AVX-512 BF16 and a kernel built with it");
  const int64_t size = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && bias.is_contiguous(), "contiguous inputs only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  bias.scalar_type() == at::kBFloat16, "layer_norm takes bf16 only");
  TORCH_CHECK(size % 16 == 0 && size <= 1024 && weight.numel() == size && bias.numel() == size, "bad width");
  auto out = at::empty_like(x);
#ifdef CONVEYOR_AMX
  layer_norm_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(bias.data_ptr<at::BFloat16>()),
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), x.numel() / size, size,
                  static_cast<float>(eps));
#endif
  return out;
}
