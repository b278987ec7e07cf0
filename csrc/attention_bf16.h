// Prefill tiles of a bf16 pool on CPUs with bf16 dot products (AVX512-BF16): the scores and
// the values as VDPBF16PS, which multiplies pairs of bf16 and adds both products to an fp32
// lane, so one instruction does the work of two fp32 FMAs and nothing is widened first.
//
// - Scores: lanes are keys, pairs run along head_dim. A span's keys are packed as 32-bit words
//   kP[p][t] = (k[t][2p], k[t][2p+1]) (a transpose of words, half the elements of the fp32
//   transpose it replaces); each query's pair (q[2p], q[2p+1]) is broadcast. The queries are
//   the bf16 values the model produced (not prescaled: the scale multiplies the scores).
// - Values: lanes are head_dim, pairs run along keys: vP[t/2][d] = (v[t][d], v[t+1][d]), and
//   the probabilities are rounded to bf16 in pairs (p[t], p[t+1]), as torch's own bf16 flash
//   attention on CPU rounds them before its second GEMM. The softmax itself (max, exp, sum)
//   stays fp32.
// Products of two bf16 are exact in fp32, so the only difference from the fp32 tiles is the
// order of the sums and the probabilities' rounding. Needs head_dim % 16 == 0; other shapes
// and builds without AVX512-BF16 take the fp32 tiles (attention_tiles.h).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

namespace streamgate::cpu {

constexpr bool kTileBf16 = true;

inline uint32_t word_at(const c10::BFloat16* p) {          // two adjacent bf16 as one 32-bit word
  uint32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

// Key t of the span (D bf16 at k) into column t of kP [D/2][kpad16].
inline void pack_key_bf16(const c10::BFloat16* k, uint32_t* kP, int64_t t, int64_t kpad16, int64_t D) {
  for (int64_t p = 0; p < D / 2; ++p) kP[p * kpad16 + t] = word_at(k + 2 * p);
}

// Values t and t+1 (v1 null past the span: zeros) into row t/2 of vP [kpad16/2][D].
inline void pack_values_bf16(const c10::BFloat16* v0, const c10::BFloat16* v1, uint32_t* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)));
    const __m512i hi = v1 ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d))), 16)
                          : _mm512_setzero_si512();
    _mm512_storeu_si512(row + d, _mm512_or_si512(lo, hi));
  }
}

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// s[j][t] = scale * q_j . k_t for R query rows (qb: R x D bf16, row stride D; s: row stride
// kpad) and t < keys (a multiple of 8, at most kpad: the keys a span uses, rounded up), 32 keys
// at a time, then 16 (the last 16 masked to keys).
template <int R>
inline void scores_rows_bf16(const c10::BFloat16* qb, const uint32_t* kP, float* s, int64_t kpad, int64_t kpad16,
                             int64_t D, float scale, int64_t keys) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t t = 0;
  for (; t + 32 <= keys; t += 32) {
    __m512 a[R], b[R];
    for (int j = 0; j < R; ++j) a[j] = b[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512i k = _mm512_loadu_si512(kP + p * kpad16 + t), k2 = _mm512_loadu_si512(kP + p * kpad16 + t + 16);
      for (int j = 0; j < R; ++j) {
        const __m512i qj = _mm512_set1_epi32(static_cast<int>(word_at(qb + j * D + 2 * p)));
        a[j] = _mm512_dpbf16_ps(a[j], as_bh(qj), as_bh(k));
        b[j] = _mm512_dpbf16_ps(b[j], as_bh(qj), as_bh(k2));
      }
    }
    for (int j = 0; j < R; ++j) {
      _mm512_storeu_ps(s + j * kpad + t, _mm512_mul_ps(a[j], sc));
      _mm512_storeu_ps(s + j * kpad + t + 16, _mm512_mul_ps(b[j], sc));
    }
  }
  for (; t < keys; t += 16) {
    const __mmask16 keep = keys - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (keys - t)) - 1);
    __m512 a[R];
    for (int j = 0; j < R; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512i k = _mm512_loadu_si512(kP + p * kpad16 + t);
      for (int j = 0; j < R; ++j)
        a[j] = _mm512_dpbf16_ps(a[j], as_bh(_mm512_set1_epi32(static_cast<int>(word_at(qb + j * D + 2 * p)))), as_bh(k));
    }
    for (int j = 0; j < R; ++j) _mm512_mask_storeu_ps(s + j * kpad + t, keep, _mm512_mul_ps(a[j], sc));
  }
}

// acc_j = alpha_j * acc_j + sum_t p_j[t] v_t for R rows over n keys (pairs of keys per step).
template <int R>
inline void values_rows_bf16(const c10::BFloat16* pb, const float* alpha, const uint32_t* vP, float* acc,
                             int64_t kpad16, int64_t n, int64_t D) {
  const int64_t pairs = (n + 1) / 2;
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m512 a[R], b[R];
    for (int j = 0; j < R; ++j) {
      const __m512 al = _mm512_set1_ps(alpha[j]);
      a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + d), al);
      b[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + d + 16), al);
    }
    for (int64_t tp = 0; tp < pairs; ++tp) {
      const __m512i v = _mm512_loadu_si512(vP + tp * D + d), v2 = _mm512_loadu_si512(vP + tp * D + d + 16);
      for (int j = 0; j < R; ++j) {
        const __m512i pj = _mm512_set1_epi32(static_cast<int>(word_at(pb + j * kpad16 + 2 * tp)));
        a[j] = _mm512_dpbf16_ps(a[j], as_bh(pj), as_bh(v));
        b[j] = _mm512_dpbf16_ps(b[j], as_bh(pj), as_bh(v2));
      }
    }
    for (int j = 0; j < R; ++j) {
      _mm512_storeu_ps(acc + j * D + d, a[j]);
      _mm512_storeu_ps(acc + j * D + d + 16, b[j]);
    }
  }
  for (; d < D; d += 16) {
    __m512 a[R];
    for (int j = 0; j < R; ++j) a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + d), _mm512_set1_ps(alpha[j]));
    for (int64_t tp = 0; tp < pairs; ++tp) {
      const __m512i v = _mm512_loadu_si512(vP + tp * D + d);
      for (int j = 0; j < R; ++j)
        a[j] = _mm512_dpbf16_ps(a[j], as_bh(_mm512_set1_epi32(static_cast<int>(word_at(pb + j * kpad16 + 2 * tp)))), as_bh(v));
    }
    for (int j = 0; j < R; ++j) _mm512_storeu_ps(acc + j * D + d, a[j]);
  }
}

// softmax_span's probabilities put straight into a row of pb as bf16 (its `put`), rounded to
// nearest even as c10::BFloat16 rounds them (no probability is subnormal: exp's argument is
// clamped at -87), instead of into the scores and rounded in a pass of their own.
struct ProbsBf16 {
  c10::BFloat16* pb;
  void operator()(int64_t t, vec16 p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(p))));
  }
  void operator()(int64_t t, vec8 p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pb + t),
                     reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(reinterpret_cast<__m256>(p))));
  }
};

// dst[d] = bf16(a[d] * inv), sixteen at a time (D % 16 == 0), rounded to nearest even as
// c10::BFloat16 rounds (the scalar conversion, with its NaN check, was ~30 % of a bf16 prefill
// tile's own instructions once the products ran on AMX).
inline void store_scaled_bf16(c10::BFloat16* dst, const float* a, float inv, int64_t D) {
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(a + d), s))));
}

}  // namespace streamgate::cpu

#else

namespace streamgate::cpu {

constexpr bool kTileBf16 = false;

inline void pack_key_bf16(const c10::BFloat16*, uint32_t*, int64_t, int64_t, int64_t) {}
inline void pack_values_bf16(const c10::BFloat16*, const c10::BFloat16*, uint32_t*, int64_t) {}
template <int R>
inline void scores_rows_bf16(const c10::BFloat16*, const uint32_t*, float*, int64_t, int64_t, int64_t, float,
                             int64_t) {}
inline void store_scaled_bf16(c10::BFloat16*, const float*, float, int64_t) {}
template <int R>
inline void values_rows_bf16(const c10::BFloat16*, const float*, const uint32_t*, float*, int64_t, int64_t, int64_t) {}

}  // namespace streamgate::cpu

#endif
