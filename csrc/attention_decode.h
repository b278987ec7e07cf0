// The decode rows' inner loops of the paged attention kernel (paged_attention.cpp) on whole
// AVX-512 registers: a decode row has one query vector per head of a GQA group (1-3 of them),
// too few to pay for transposing keys, so scores are dot products against keys read in place
// and values are accumulated from values read in place, in any storage dtype (bf16 and fp16
// are widened to fp32 in registers, so nothing is copied into a buffer first; an int8 pool's
// rows, kv_int8.h, too: a key's scale multiplies its scores, a value's its probabilities).
//
// Against attention_tiles.h's eight-lane versions: half the instructions per key (a head_dim
// of 64 is four registers), no conversion pass for bf16, and one pass over the span's values
// for a whole 64-wide slice of head_dim instead of one per 16 lanes. Used for decode rows
// (decode_sequence: one work item per sequence, all its KV heads) where the compiler targets
// AVX-512 (built with -march=native) and head_dim is a multiple of 16.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "attention_loads.h"
#include "attention_parts.h"
#include "attention_tiles.h"
#include "kv_int8.h"

namespace streamgate::cpu {

#ifdef __AVX512F__
constexpr bool kDecode512 = true;

// [sum(a[0]), ..., sum(a[3])]: four horizontal sums in one 128-bit vector.
inline __m128 sum4_512(const __m512* a) {
  __m256 h[4];
  for (int i = 0; i < 4; ++i)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// s[j * kpad + t] = q_j . k_t for R query vectors (fp32, scaled) and keys t < n read in place
// (krow[t]: key t's D values); D a multiple of 16. Four keys at a time, each loaded once per 16
// of d for all R rows (up to 12 accumulators), their dot products reduced across lanes together.
template <int R, typename T>
inline void scores_decode(const float* q, const T* const* krow, float* s, int64_t kpad, int64_t n, int64_t D) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m512 a[R][4];
    for (int j = 0; j < R; ++j)
      for (int i = 0; i < 4; ++i) a[j][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m512 qv[R];
      for (int j = 0; j < R; ++j) qv[j] = _mm512_loadu_ps(q + j * D + d);
      for (int i = 0; i < 4; ++i) {
        const __m512 k = load16(krow[t + i] + d);
        for (int j = 0; j < R; ++j) a[j][i] = _mm512_fmadd_ps(qv[j], k, a[j][i]);
      }
    }
    for (int j = 0; j < R; ++j) _mm_storeu_ps(s + j * kpad + t, sum4_512(a[j]));
  }
  for (; t < n; ++t) {
    __m512 a[R];
    for (int j = 0; j < R; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 k = load16(krow[t] + d);
      for (int j = 0; j < R; ++j) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * D + d), k, a[j]);
    }
    for (int j = 0; j < R; ++j) s[j * kpad + t] = _mm512_reduce_add_ps(a[j]);
  }
}

// acc_j[d0, d0 + 16 C) = alpha_j * acc_j + sum_t p_j[t] v_t over that slice: R x C registers.
template <int R, int C, typename T>
inline void values_slice(const float* p, const float* alpha, const T* const* vrow, float* acc, int64_t kpad,
                         int64_t n, int64_t D, int64_t d0) {
  __m512 a[R][C];
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) a[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + d0 + 16 * c), _mm512_set1_ps(alpha[j]));
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(vrow[t] + d0 + 16 * c);
    for (int j = 0; j < R; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j * kpad + t]);
      for (int c = 0; c < C; ++c) a[j][c] = _mm512_fmadd_ps(pj, v[c], a[j][c]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * D + d0 + 16 * c, a[j][c]);
}

// acc_j = alpha_j * acc_j + sum_t p_j[t] v_t for R query vectors over values read in place
// (vrow[t]: value t's D values); D a multiple of 16, taken 64 at a time.
template <int R, typename T>
inline void values_decode(const float* p, const float* alpha, const T* const* vrow, float* acc, int64_t kpad,
                          int64_t n, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) values_slice<R, 4>(p, alpha, vrow, acc, kpad, n, D, d0);
  switch ((D - d0) / 16) {
    case 3: values_slice<R, 3>(p, alpha, vrow, acc, kpad, n, D, d0); break;
    case 2: values_slice<R, 2>(p, alpha, vrow, acc, kpad, n, D, d0); break;
    case 1: values_slice<R, 1>(p, alpha, vrow, acc, kpad, n, D, d0); break;
    default: break;
  }
}

// Scratch of one thread for decode_sequence, fit for `heads` query heads of head_dim D.
template <typename T>
struct DecodeScratch {
  std::vector<float> qf, acc, m, l, alpha, s;
  std::vector<float> sums;                         // a row's parts' (attention_parts.h)
  std::vector<int64_t> base;
  std::vector<const T*> kin, vin;
  void fit(int64_t heads, int64_t D, int64_t kpad) {
    at_least(qf, heads * D), at_least(acc, heads * D), at_least(s, heads * kpad);
    at_least(m, heads), at_least(l, heads), at_least(alpha, heads);
    at_least(base, kpad), at_least(kin, kpad), at_least(vin, kpad);
  }
};

// Runs f.template operator()<R>() for R = r in 1..3.
template <typename F>
inline void with_rows(int64_t r, F&& f) {
  if (r == 1) f.template operator()<1>();
  else if (r == 2) f.template operator()<2>();
  else f.template operator()<3>();
}

// The span walk of a decode row: for each span of its context, the slots' offsets, the next span's
// K/V brought into cache (above), then head(h, n) for each KV head h with kin/vin at its n keys and
// values in place: every slot's heads are read while the span is in cache, once.
// Keys from `begin` (a sliding window's first key, or a part's, else 0) to ctx - 1; KV heads
// [h0, h1) of the kv_heads (a sequence decoded alone is split by head over the threads:
// attention_items.h). chain: the row's parts walked one after another (attention_parts.h).
template <typename T, typename F>
inline void for_decode_spans(const T* kp, const T* vp, int64_t kv_slot, int64_t kv_hs, const int64_t* table,
                             int64_t block_size, int64_t begin, int64_t ctx, int64_t span, int64_t kv_heads,
                             int64_t h0, int64_t h1, int64_t* base, const T** kin, const T** vin, const SpanChain& chain,
                             F&& head) {
  const bool loads = decode_span_loads().load(std::memory_order_relaxed);
  const int64_t r0 = h0 * kv_hs * sizeof(T), r1 = (h1 == kv_heads ? kv_slot : h1 * kv_hs) * sizeof(T);
  if (loads && !chain.loaded) load_span(kp, vp, kv_slot, table, block_size, begin, std::min(ctx, begin + span), r0, r1);
  for (int64_t b0 = begin; b0 < ctx; b0 += span) {
    const int64_t n = std::min(span, ctx - b0);
    for (int64_t t = 0; t < n;) {                        // block by block: one division a block
      const int64_t pos = b0 + t, in_block = std::min(block_size - pos % block_size, n - t);
      const int64_t first = (table[pos / block_size] * block_size + pos % block_size) * kv_slot;
      for (int64_t e = 0; e < in_block; ++e, ++t) base[t] = first + e * kv_slot;
    }
    // The next span: this walk's, or after its last the next part's first.
    const bool last = b0 + span >= ctx;
    const int64_t next0 = last ? chain.next0 : b0 + span, next1 = last ? chain.next1 : std::min(ctx, b0 + 2 * span);
    if (loads) load_span(kp, vp, kv_slot, table, block_size, next0, next1, r0, r1);
    const int64_t block_bytes = block_size * kv_slot * sizeof(T);
    const bool all = h0 == 0 && h1 == kv_heads;
    for (int64_t h = h0; h < h1; ++h) {
      // Prefetch: the next span's blocks, a 1/kv_heads share before each head. A range of heads
      // prefetches only its own rows of each slot (the other heads' thread fetches theirs).
      const int64_t from = block_bytes * h / kv_heads, to = block_bytes * (h + 1) / kv_heads;
      for (int64_t pos = next0; !loads && pos < next1; pos += block_size) {
        const int64_t first = table[pos / block_size] * block_size * kv_slot;
        const char *kb = reinterpret_cast<const char*>(kp + first), *vb = reinterpret_cast<const char*>(vp + first);
        if (all) {
          for (int64_t off = from / 64 * 64; off < to; off += 64) {
            _mm_prefetch(kb + off, _MM_HINT_T0);
            _mm_prefetch(vb + off, _MM_HINT_T0);
          }
          continue;
        }
        const int64_t row0 = h * kv_hs * sizeof(T), row1 = row0 + kv_hs * sizeof(T);
        for (int64_t e = 0; e < block_size; ++e) {
          const int64_t slot = e * kv_slot * sizeof(T);
          for (int64_t off = (slot + row0) / 64 * 64; off < slot + row1; off += 64) {
            _mm_prefetch(kb + off, _MM_HINT_T0);
            _mm_prefetch(vb + off, _MM_HINT_T0);
          }
        }
      }
      for (int64_t t = 0; t < n; ++t) {
        kin[t] = kp + base[t] + h * kv_hs;
        vin[t] = vp + base[t] + h * kv_hs;
      }
      head(h, n);
    }
  }
}

// s[t] *= the scale of row t (kv_int8.h) for t < n, for `group` query vectors kpad apart.
inline void scale_by_rows(float* s, int64_t kpad, int64_t group, const int8_t* const* rows, int64_t n, int64_t D) {
  for (int64_t t = 0; t < n; ++t) {
    const float c = row_scale(rows[t], D);
    for (int64_t j = 0; j < group; ++j) s[j * kpad + t] *= c;
  }
}

// One decode row (the sequence's last position, attending to all ctx keys, or its window's),
// or one part of its keys (attention_parts.h), for KV heads [h0, h1) of its sequence at once
// (all of them, or a thread's share when a one-part sequence is decoded alone), span by span
// (for_decode_spans). group <= 3
// query heads per KV head; f: the layer's features (window, soft-cap, sinks).
// q/o: the row's [heads, D] (head strides q_hs, o_hs); pools [slots, kv_heads, D] of P, which
// is T or int8 (rows of D values and a scale, kv_int8.h).
template <typename T, typename P = T>
void decode_sequence(const T* q, int64_t q_hs, const P* kp, const P* vp, int64_t kv_slot, int64_t kv_hs,
                     const int64_t* table, int64_t block_size, const DecodeKeys& keys, int64_t span, int64_t kpad,
                     int64_t kv_heads, int64_t h0, int64_t h1, int64_t group, int64_t D, float scale, T* o,
                     int64_t o_hs, DecodeScratch<P>& w, const Features& f) {
  const int64_t i_begin = h0 * group, i_end = h1 * group;             // query heads
  for (int64_t i = i_begin; i < i_end; ++i)
    for (int64_t d = 0; d < D; ++d) w.qf[i * D + d] = static_cast<float>(q[i * q_hs + d]) * scale;
  auto start = [&](bool first) { start_heads(f, first, w, i_begin, i_end, D); };
  auto walk = [&](int64_t k0, int64_t k1, const SpanChain& chain) {
    for_decode_spans(kp, vp, kv_slot, kv_hs, table, block_size, k0, k1, span, kv_heads, h0, h1, w.base.data(),
                     w.kin.data(), w.vin.data(), chain, [&](int64_t h, int64_t n) {
      const int64_t i0 = h * group;
      with_rows(group, [&]<int R>() { scores_decode<R>(w.qf.data() + i0 * D, w.kin.data(), w.s.data() + i0 * kpad, kpad, n, D); });
      if constexpr (std::is_same_v<P, int8_t>) scale_by_rows(w.s.data() + i0 * kpad, kpad, group, w.kin.data(), n, D);
      for (int64_t i = i0; i < i0 + group; ++i) {
        f.cap(w.s.data() + i * kpad, 0, n);
        const float sum = softmax_span(w.s.data() + i * kpad, n, n, w.m[i], w.alpha[i]);
        w.l[i] = w.l[i] * w.alpha[i] + sum;
      }
      if constexpr (std::is_same_v<P, int8_t>) scale_by_rows(w.s.data() + i0 * kpad, kpad, group, w.vin.data(), n, D);
      with_rows(group, [&]<int R>() {
        values_decode<R>(w.s.data() + i0 * kpad, w.alpha.data() + i0, w.vin.data(), w.acc.data() + i0 * D, kpad, n, D);
      });
    });
  };
  auto finish = [&](float* sums) {
    for (int64_t i = i_begin; i < i_end; ++i) {
      if (sums) {
        float* h = sums + i * part_floats(D);
        std::copy(w.acc.begin() + i * D, w.acc.begin() + (i + 1) * D, h);
        h[D] = w.m[i], h[D + 1] = w.l[i];
        continue;
      }
      const float inv = 1.0f / w.l[i];
      for (int64_t d = 0; d < D; ++d) o[i * o_hs + d] = static_cast<T>(w.acc[i * D + d] * inv);
    }
  };
  const int64_t heads = kv_heads * group;
  if (float* sums = for_decode_parts(keys, block_size, heads * part_floats(D), w.sums, start, walk, finish))
    merge_decode_parts(sums, keys.parts, heads, D, o, o_hs,
                       [D](T* dst, const float* a, float inv) { store_scaled(dst, a, inv, D); });
}
#else
constexpr bool kDecode512 = false;

template <typename T>
struct DecodeScratch {
  void fit(int64_t, int64_t, int64_t) {}
};

template <typename T, typename P = T>
void decode_sequence(const T*, int64_t, const P*, const P*, int64_t, int64_t, const int64_t*, int64_t, const DecodeKeys&, int64_t,
                     int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, T*, int64_t, DecodeScratch<P>&,
                     const Features&) {}
#endif

}  // namespace streamgate::cpu
