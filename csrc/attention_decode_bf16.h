// Decode rows of a bf16 pool on bf16 dot products (AVX512-BF16): decode_sequence
// (attention_decode.h) with VDPBF16PS in place of widening each key and value to fp32 and
// FMAs, so a 32-wide slice of head_dim is one load and one instruction per query head.
//
// - Scores: lanes are pairs along head_dim; the query stays bf16 (as the model produced it,
//   the scale multiplies the sums), four keys' dot products are reduced across lanes together.
// - Values: pairs run along keys. Values t and t+1 are interleaved in registers
//   (unpacklo/unpackhi of 16-bit elements), which puts head_dim in a fixed permuted order
//   within each 32-wide slice; the accumulators keep that order until the output is written.
//   The probabilities are rounded to bf16 in pairs, as torch's bf16 flash attention on CPU
//   rounds them before its second GEMM; the softmax itself stays fp32.
// Needs head_dim % 32 == 0; other shapes keep decode_sequence.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_bf16.h"
#include "attention_decode.h"

namespace streamgate::cpu {

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kDecodeBf16 = true;

// s[j * kpad + t] = scale * q_j . k_t for R bf16 query vectors and keys t < n read in place.
template <int R>
inline void scores_decode_bf16(const c10::BFloat16* q, const c10::BFloat16* const* krow, float* s, int64_t kpad,
                               int64_t n, int64_t D, float scale) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m512 a[R][4];
    for (int j = 0; j < R; ++j)
      for (int i = 0; i < 4; ++i) a[j][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      __m512i qv[R];
      for (int j = 0; j < R; ++j) qv[j] = _mm512_loadu_si512(q + j * D + d);
      for (int i = 0; i < 4; ++i) {
        const __m512i k = _mm512_loadu_si512(krow[t + i] + d);
        for (int j = 0; j < R; ++j) a[j][i] = _mm512_dpbf16_ps(a[j][i], as_bh(qv[j]), as_bh(k));
      }
    }
    for (int j = 0; j < R; ++j) _mm_storeu_ps(s + j * kpad + t, _mm_mul_ps(sum4_512(a[j]), _mm_set1_ps(scale)));
  }
  for (; t < n; ++t) {
    __m512 a[R];
    for (int j = 0; j < R; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i k = _mm512_loadu_si512(krow[t] + d);
      for (int j = 0; j < R; ++j) a[j] = _mm512_dpbf16_ps(a[j], as_bh(_mm512_loadu_si512(q + j * D + d)), as_bh(k));
    }
    for (int j = 0; j < R; ++j) s[j * kpad + t] = _mm512_reduce_add_ps(a[j]) * scale;
  }
}

// acc_j[d0, d0 + 32 C) (permuted, see above) = alpha_j * acc_j + sum_t p_j[t] v_t, two keys a step.
template <int R, int C>
inline void values_slice_bf16(const c10::BFloat16* pb, int64_t pstride, const float* alpha,
                              const c10::BFloat16* const* vrow, float* acc, int64_t n, int64_t D, int64_t d0) {
  __m512 lo[R][C], hi[R][C];
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) {
      const __m512 al = _mm512_set1_ps(alpha[j]);
      lo[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + d0 + 32 * c), al);
      hi[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + d0 + 32 * c + 16), al);
    }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < n; t += 2) {
    __m512i plo[C], phi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(vrow[t] + d0 + 32 * c);
      const __m512i y = t + 1 < n ? _mm512_loadu_si512(vrow[t + 1] + d0 + 32 * c) : zero;
      plo[c] = _mm512_unpacklo_epi16(x, y);
      phi[c] = _mm512_unpackhi_epi16(x, y);
    }
    for (int j = 0; j < R; ++j) {
      const __m512i pj = _mm512_set1_epi32(static_cast<int>(word_at(pb + j * pstride + t)));
      for (int c = 0; c < C; ++c) {
        lo[j][c] = _mm512_dpbf16_ps(lo[j][c], as_bh(pj), as_bh(plo[c]));
        hi[j][c] = _mm512_dpbf16_ps(hi[j][c], as_bh(pj), as_bh(phi[c]));
      }
    }
  }
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(acc + j * D + d0 + 32 * c, lo[j][c]);
      _mm512_storeu_ps(acc + j * D + d0 + 32 * c + 16, hi[j][c]);
    }
}

// Where head_dim offset r (< 32) of a slice sits in the accumulators: unpacklo puts the pairs of
// offsets 8k + w (w < 4) in lane 4k + w, unpackhi those of 8k + 4 + w in lane 16 + 4k + w.
inline int64_t permuted(int64_t r) {
  const int64_t k = r / 8, w = r % 8;
  return w < 4 ? 4 * k + w : 16 + 4 * k + (w - 4);
}

// dst[d] = bf16(acc[d / 32 * 32 + permuted(d % 32)] * inv) for d < D (head_dim offset d sits there
// in a head's accumulators): each 32-wide slice's halves put back in order by
// one VPERMT2PS each, scaled, rounded to nearest even by VCVTNEPS2BF16 (as store_scaled_bf16; it
// flushes subnormal results, c10::BFloat16 keeps them). It replaced a scalar loop (an index and a
// conversion an element): SmolLM2's decode attention (30 layers, bits equal) 12.13 -> 11.70 ms at 32
// rows over 300-380 tokens, 3.32 -> 3.30 at 8, 1.45 -> 1.41 at 8 over 100-200 (Zen 4 host,
// 2026-12-06, alternating in one process).
inline void store_unpermuted_bf16(c10::BFloat16* dst, const float* acc, float inv, int64_t D) {
  alignas(64) static const auto order = [] {
    std::array<int32_t, 32> o{};
    for (int r = 0; r < 32; ++r) o[r] = static_cast<int32_t>(permuted(r));
    return o;
  }();
  const __m512i first = _mm512_load_si512(order.data()), second = _mm512_load_si512(order.data() + 16);
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 32) {
    const __m512 a = _mm512_loadu_ps(acc + d), b = _mm512_loadu_ps(acc + d + 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<__m256i>(
        _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(a, first, b), s))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d + 16), reinterpret_cast<__m256i>(
        _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(a, second, b), s))));
  }
}

struct DecodeScratchBf16 {
  std::vector<c10::BFloat16> qb, pb;
  std::vector<float> acc, m, l, alpha, s;
  std::vector<float> sums;                         // a row's parts' (attention_parts.h)
  std::vector<int64_t> base;
  std::vector<const c10::BFloat16*> kin, vin;
  int64_t pstride = 0;
  void fit(int64_t heads, int64_t D, int64_t kpad) {
    pstride = kpad + 2;
    at_least(qb, heads * D), at_least(pb, heads * pstride), at_least(acc, heads * D), at_least(s, heads * kpad);
    at_least(m, heads), at_least(l, heads), at_least(alpha, heads);
    at_least(base, kpad), at_least(kin, kpad), at_least(vin, kpad);
  }
};

// decode_sequence for a bf16 pool and head_dim % 32 == 0 (same arguments, same order of work).
inline void decode_sequence_bf16(const c10::BFloat16* q, int64_t q_hs, const c10::BFloat16* kp,
                                 const c10::BFloat16* vp, int64_t kv_slot, int64_t kv_hs, const int64_t* table,
                                 int64_t block_size, const DecodeKeys& keys, int64_t span, int64_t kpad, int64_t kv_heads,
                                 int64_t h0, int64_t h1, int64_t group, int64_t D, float scale, c10::BFloat16* o,
                                 int64_t o_hs, DecodeScratchBf16& w, const Features& f) {
  const int64_t i_begin = h0 * group, i_end = h1 * group;             // query heads
  for (int64_t i = i_begin; i < i_end; ++i) std::copy(q + i * q_hs, q + i * q_hs + D, w.qb.data() + i * D);
  auto start = [&](bool first) { start_heads(f, first, w, i_begin, i_end, D); };
  auto walk = [&](int64_t k0, int64_t k1, const SpanChain& chain) {
    for_decode_spans(kp, vp, kv_slot, kv_hs, table, block_size, k0, k1, span, kv_heads, h0, h1, w.base.data(),
                     w.kin.data(), w.vin.data(), chain, [&](int64_t h, int64_t n) {
      const int64_t i0 = h * group;
      with_rows(group, [&]<int R>() {
        scores_decode_bf16<R>(w.qb.data() + i0 * D, w.kin.data(), w.s.data() + i0 * kpad, kpad, n, D, scale);
      });
      for (int64_t i = i0; i < i0 + group; ++i) {
        f.cap(w.s.data() + i * kpad, 0, n);
        const float sum = softmax_span(w.s.data() + i * kpad, n, n, w.m[i], w.alpha[i], 0, ProbsBf16{w.pb.data() + i * w.pstride});
        w.l[i] = w.l[i] * w.alpha[i] + sum;
      }
      with_rows(group, [&]<int R>() {
        const c10::BFloat16* pb = w.pb.data() + i0 * w.pstride;
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64)
          values_slice_bf16<R, 2>(pb, w.pstride, w.alpha.data() + i0, w.vin.data(), w.acc.data() + i0 * D, n, D, d0);
        if (d0 < D) values_slice_bf16<R, 1>(pb, w.pstride, w.alpha.data() + i0, w.vin.data(), w.acc.data() + i0 * D, n, D, d0);
      });
    });
  };
  auto finish = [&](float* sums) {
    for (int64_t i = i_begin; i < i_end; ++i) {
      const float* acc = w.acc.data() + i * D;
      if (sums) {                                   // permuted as the accumulators are
        float* h = sums + i * part_floats(D);
        std::copy(acc, acc + D, h);
        h[D] = w.m[i], h[D + 1] = w.l[i];
        continue;
      }
      store_unpermuted_bf16(o + i * o_hs, acc, 1.0f / w.l[i], D);
    }
  };
  const int64_t heads = kv_heads * group;
  if (float* sums = for_decode_parts(keys, block_size, heads * part_floats(D), w.sums, start, walk, finish))
    merge_decode_parts(sums, keys.parts, heads, D, o, o_hs, [D](c10::BFloat16* dst, const float* a, float inv) {
      store_unpermuted_bf16(dst, a, inv, D);
    });
}
#else
constexpr bool kDecodeBf16 = false;

inline void store_unpermuted_bf16(c10::BFloat16*, const float*, float, int64_t) {}

struct DecodeScratchBf16 {
  void fit(int64_t, int64_t, int64_t) {}
};

inline void decode_sequence_bf16(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t,
                                 int64_t, const int64_t*, int64_t, const DecodeKeys&, int64_t, int64_t, int64_t, int64_t, int64_t,
                                 int64_t, int64_t, float, c10::BFloat16*, int64_t, DecodeScratchBf16&, const Features&) {}
#endif

}  // namespace streamgate::cpu
