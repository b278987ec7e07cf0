// One span of keys for a query tile on the VDPBF16PS tiles (attention_bf16.h's products), the
// path of every bf16 prefill chunk on a CPU with AVX512-BF16 and no AMX (attention_run.h):
//   - keys packed in pairs sixteen at a time, as a 16 x 16 transpose of 32-bit words (a block's
//     sixteen keys are rows of the pool a slot apart; an int8 pool's once rounded to bf16 rows),
//     not word by word;
//   - scores and values eight query vectors at a time (sixteen accumulators: every key or value
//     vector loaded serves eight rows, against four before);
//   - the online softmax writing its probabilities straight to bf16 pairs, not to fp32 first
//     and then rounded in a pass of its own.
// The same products, sums and roundings in the same order as the four-row loops with
// softmax_span and a rounding pass had (until 2026-12-07): the same bits.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention_bf16.h"
#include "attention_softmax.h"
#include "attention_tiles.h"
#include "kv_int8.h"
#include "simd.h"

namespace streamgate::cpu {

// The tile's buffers (attention_run.h's scratch) and where its nq query vectors stand.
struct TileBf16 {
  const c10::BFloat16* qb;       // [nq][D] queries
  const uint32_t *kP, *vP;       // the span's keys and values packed in pairs
  float* s;                      // [nq][kpad] scores
  c10::BFloat16* pb;             // [nq][kpad16] probabilities
  float *acc, *m, *l, *alpha;    // [nq][D] outputs so far; the online softmax's state per vector
  const int64_t* qpos;           // each vector's position in its sequence
  int64_t nq, kpad, kpad16, D;
  float scale;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)

// r[c] = column c of the 16 x 16 matrix of 32-bit words whose rows were r[0..15].
inline void transpose16_words(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {        // r[i + j]: word 4L + j of rows i..i+3 in 128-bit lane L
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), w = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
    const __m512i x = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88), y = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
    t[j] = _mm512_shuffle_i32x4(v, x, 0x88);          // word j
    t[8 + j] = _mm512_shuffle_i32x4(v, x, 0xDD);      // word 8 + j
    t[4 + j] = _mm512_shuffle_i32x4(w, y, 0x88);      // word 4 + j
    t[12 + j] = _mm512_shuffle_i32x4(w, y, 0xDD);     // word 12 + j
  }
  for (int c = 0; c < 16; ++c) r[c] = t[c];
}

// Keys t..t+15 of the span (rows k, k + stride, ... of the pool: one block's) into columns
// t..t+15 of kP [D/2][kpad16], as pack_key_bf16 packs them one by one; t % 16 == 0, D % 32 == 0.
inline void pack_keys16_bf16(const c10::BFloat16* k, int64_t stride, uint32_t* kP, int64_t t, int64_t kpad16,
                             int64_t D) {
  for (int64_t w0 = 0; w0 < D / 2; w0 += 16) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(k + i * stride + 2 * w0);
    transpose16_words(r);
    for (int c = 0; c < 16; ++c) _mm512_storeu_si512(kP + (w0 + c) * kpad16 + t, r[c]);
  }
}

// Keys and values t..t+in_block of the span, one block's (pool rows k + e * stride, v + e *
// stride), for the tile: keys into kP in pairs (pack_keys16_bf16 where sixteen start at a
// multiple of sixteen and D % 32 == 0, else pack_key_bf16), and where each value row is read
// into vsrc. An int8 pool's rows (kv_int8.h) are first rounded to bf16 rows in kq / vq (the
// span's key t at kq + t * D), then packed alike.
template <typename pool_t>
inline void pack_block_bf16(const pool_t* k, const pool_t* v, int64_t stride, int64_t t, int64_t in_block,
                            uint32_t* kP, int64_t kpad16, int64_t D, c10::BFloat16* kq, c10::BFloat16* vq,
                            const c10::BFloat16** vsrc) {
  for (int64_t e = 0; e < in_block;) {
    const int64_t n = in_block - e >= 16 && (t + e) % 16 == 0 && D % 32 == 0 ? 16 : 1;
    for (int64_t j = e; j < e + n; ++j) {
      if constexpr (std::is_same_v<pool_t, int8_t>) {
        dequant_row_bf16(k + j * stride, kq + (t + j) * D, D);
        dequant_row_bf16(v + j * stride, vq + (t + j) * D, D);
        vsrc[t + j] = vq + (t + j) * D;
      } else {
        vsrc[t + j] = v + j * stride;
      }
    }
    const c10::BFloat16* rows;
    int64_t rows_stride;
    if constexpr (std::is_same_v<pool_t, int8_t>) rows = kq + (t + e) * D, rows_stride = D;
    else rows = k + e * stride, rows_stride = stride;
    if (n == 16) pack_keys16_bf16(rows, rows_stride, kP, t + e, kpad16, D);
    else pack_key_bf16(rows, kP, t + e, kpad16, D);
    e += n;
  }
}

// Runs f.template operator()<R>(i) over rows i of nq, eight at a time, then for_row_groups's.
template <typename F>
inline void for_rows8(int64_t nq, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= nq; i += 8) f.template operator()<8>(i);
  for_row_groups(nq - i, [&]<int R>(int64_t j) { f.template operator()<R>(i + j); });
}

// One span of n keys from position b0 (packed in kP, vP) for the tile's vectors: scores,
// softmax (causal cut, window, soft cap) and outputs += P V.
template <class Feat>
inline void tile_span_bf16(const TileBf16& x, int64_t b0, int64_t n, const Feat& f) {
  const int64_t keys = std::min(x.kpad, (n + 7) / 8 * 8);          // keys >= n: never read
  for_rows8(x.nq, [&]<int R>(int64_t i) {
    scores_rows_bf16<R>(x.qb + i * x.D, x.kP, x.s + i * x.kpad, x.kpad, x.kpad16, x.D, x.scale, keys);
  });
  softmax_rows(x.s, x.kpad, x.nq, x.qpos, b0, n, f, x.m, x.l, x.alpha,
               [&](int64_t i) { return ProbsBf16{x.pb + i * x.kpad16}; });
  for_rows8(x.nq, [&]<int R>(int64_t i) {
    values_rows_bf16<R>(x.pb + i * x.kpad16, x.alpha + i, x.vP, x.acc + i * x.D, x.kpad16, n, x.D);
  });
}

#else

template <typename pool_t>
inline void pack_block_bf16(const pool_t*, const pool_t*, int64_t, int64_t, int64_t, uint32_t*, int64_t, int64_t,
                            c10::BFloat16*, c10::BFloat16*, const c10::BFloat16**) {}
template <class Feat>
inline void tile_span_bf16(const TileBf16&, int64_t, int64_t, const Feat&) {}

#endif

}  // namespace streamgate::cpu
