// The inner loops of the paged attention kernel (paged_attention.cpp): scores of a few query
// vectors against a span of keys, and their probabilities times the values, with the
// accumulators in registers (the online softmax between them: attention_softmax.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention_softmax.h"
#include "simd.h"

namespace streamgate::cpu {

constexpr int64_t kRows = 4;         // query vectors per step of the score microkernel

// A layer's attention features, all off by default. window > 0: query position p attends to
// keys (p - window, p] only (a sliding layer; keys before are neither read nor weighted);
// softcap > 0: scores become softcap * tanh(score / softcap) (Gemma 2); sinks: one logit per
// query head that joins every softmax's denominator and weighs no value (gpt-oss).
struct Features {
  int64_t window = 0;
  float softcap = 0.0f;
  const float* sinks = nullptr;

  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  void cap(float* s, int64_t lo, int64_t hi) const {
    if (softcap > 0.0f)
      for (int64_t t = lo; t < hi; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  }
  // The online softmax's starting max and sum for query head `head`: the sink counts as one
  // more score, seen before any key.
  void start(float& m, float& l, int64_t head) const {
    m = sinks ? sinks[head] : -std::numeric_limits<float>::infinity();
    l = sinks ? 1.0f : 0.0f;
  }
};

// S[j, t] = q_j . k_t for R query rows j (R <= kRows) and t < kpad (a multiple of kLanes): a few
// queries times a span of keys as outer products, so that every key vector loaded serves R
// queries, the accumulators stay in registers over d, and nothing is reduced across lanes.
template <int R>
inline void scores_rows(const float* q, const float* kT, float* s, int64_t kpad, int64_t D) {
  int64_t t = 0;
#ifdef __AVX512F__
  // Thirty-two keys at a time on whole AVX-512 registers (2R accumulators), then the lanes below.
  for (; t + 32 <= kpad; t += 32) {
    __m512 a[R], b[R];
    for (int j = 0; j < R; ++j) a[j] = b[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 k = _mm512_loadu_ps(kT + d * kpad + t), k2 = _mm512_loadu_ps(kT + d * kpad + t + 16);
      for (int j = 0; j < R; ++j) {
        const __m512 qj = _mm512_set1_ps(q[j * D + d]);
        a[j] = _mm512_fmadd_ps(qj, k, a[j]);
        b[j] = _mm512_fmadd_ps(qj, k2, b[j]);
      }
    }
    for (int j = 0; j < R; ++j) {
      _mm512_storeu_ps(s + j * kpad + t, a[j]);
      _mm512_storeu_ps(s + j * kpad + t + 16, b[j]);
    }
  }
#endif
  for (; t + 2 * kLanes <= kpad; t += 2 * kLanes) {
    vec8 a[R] = {}, b[R] = {};
    for (int64_t d = 0; d < D; ++d) {
      const vec8 k = load8(kT + d * kpad + t), k2 = load8(kT + d * kpad + t + kLanes);
      for (int j = 0; j < R; ++j) {
        a[j] += q[j * D + d] * k;
        b[j] += q[j * D + d] * k2;
      }
    }
    for (int j = 0; j < R; ++j) {
      store8(s + j * kpad + t, a[j]);
      store8(s + j * kpad + t + kLanes, b[j]);
    }
  }
  for (; t < kpad; t += kLanes) {
    vec8 a[R] = {};
    for (int64_t d = 0; d < D; ++d) {
      const vec8 k = load8(kT + d * kpad + t);
      for (int j = 0; j < R; ++j) a[j] += q[j * D + d] * k;
    }
    for (int j = 0; j < R; ++j) store8(s + j * kpad + t, a[j]);
  }
}


// The same scores from keys read in place, row by row (krow[t] -> key t's D values), as dot
// products: for the few query vectors of a decode row, transposing each key would cost more.
// Called for fewer than kRows query vectors (R <= 3). With AVX2, four keys at a time: each key is
// loaded once per eight of d for all R rows (up to 12 accumulators in registers), and the four
// keys' dot products are reduced across lanes together.
template <int R>
inline void scores_rows_by_key(const float* q, const float* const* krow, float* s, int64_t kpad, int64_t n, int64_t D) {
  int64_t t = 0;
#ifdef __AVX2__
  // (Instantiated for kRows rows too, by for_row_groups, but never called with them.)
  if constexpr (R < kRows) {
    for (; D % kLanes == 0 && t + 4 <= n; t += 4) {
      __m256 a[R][4];
      for (int j = 0; j < R; ++j)
        for (int i = 0; i < 4; ++i) a[j][i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += kLanes) {
        __m256 qv[R];
        for (int j = 0; j < R; ++j) qv[j] = _mm256_loadu_ps(q + j * D + d);
        for (int i = 0; i < 4; ++i) {
          const __m256 k = _mm256_loadu_ps(krow[t + i] + d);
          for (int j = 0; j < R; ++j) a[j][i] = _mm256_fmadd_ps(qv[j], k, a[j][i]);
        }
      }
      for (int j = 0; j < R; ++j) _mm_storeu_ps(s + j * kpad + t, sum4(a[j]));
    }
  }
#endif
  for (; t < n; ++t) {
    const float* k = krow[t];
    vec8 a[R] = {};
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      const vec8 kv = load8(k + d);
      for (int j = 0; j < R; ++j) a[j] += load8(q + j * D + d) * kv;
    }
    for (int j = 0; j < R; ++j) {
      float dot = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) dot += a[j][l];
      for (int64_t r = d; r < D; ++r) dot += q[j * D + r] * k[r];        // head_dim not a multiple of kLanes
      s[j * kpad + t] = dot;
    }
  }
}

// acc_j = alpha_j * acc_j + sum_t p_j[t] v_t over values read in place (vrow[t] -> value t):
// sixteen lanes of each of R rows stay in registers over t.
template <int R>
inline void values_rows_by_key(const float* p, const float* alpha, const float* const* vrow, float* acc,
                               int64_t kpad, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    vec8 a[R], b[R];
    for (int j = 0; j < R; ++j) {
      a[j] = load8(acc + j * D + d) * alpha[j];
      b[j] = load8(acc + j * D + d + kLanes) * alpha[j];
    }
    for (int64_t t = 0; t < n; ++t) {
      const vec8 v = load8(vrow[t] + d), v2 = load8(vrow[t] + d + kLanes);
      for (int j = 0; j < R; ++j) {
        a[j] += p[j * kpad + t] * v;
        b[j] += p[j * kpad + t] * v2;
      }
    }
    for (int j = 0; j < R; ++j) {
      store8(acc + j * D + d, a[j]);
      store8(acc + j * D + d + kLanes, b[j]);
    }
  }
  for (; d < D; ++d) {                                      // head_dim not a multiple of 16
    for (int j = 0; j < R; ++j) {
      float a = acc[j * D + d] * alpha[j];
      for (int64_t t = 0; t < n; ++t) a += p[j * kpad + t] * vrow[t][d];
      acc[j * D + d] = a;
    }
  }
}

// acc_j = alpha_j * acc_j + sum_t p_j[t] v_t for R query rows over n keys: each V vector loaded
// serves R rows, and the accumulators stay in registers over t.
template <int R>
inline void values_rows(const float* p, const float* alpha, const float* vb, float* acc, int64_t kpad,
                        int64_t n, int64_t D) {
  int64_t d = 0;
#ifdef __AVX512F__
  // Thirty-two lanes of head_dim at a time on whole AVX-512 registers, then the lanes below.
  for (; d + 32 <= D; d += 32) {
    __m512 a[R], b[R];
    for (int j = 0; j < R; ++j) {
      const __m512 al = _mm512_set1_ps(alpha[j]);
      a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + d), al);
      b[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + d + 16), al);
    }
    for (int64_t t = 0; t < n; ++t) {
      const __m512 v = _mm512_loadu_ps(vb + t * D + d), v2 = _mm512_loadu_ps(vb + t * D + d + 16);
      for (int j = 0; j < R; ++j) {
        const __m512 pj = _mm512_set1_ps(p[j * kpad + t]);
        a[j] = _mm512_fmadd_ps(pj, v, a[j]);
        b[j] = _mm512_fmadd_ps(pj, v2, b[j]);
      }
    }
    for (int j = 0; j < R; ++j) {
      _mm512_storeu_ps(acc + j * D + d, a[j]);
      _mm512_storeu_ps(acc + j * D + d + 16, b[j]);
    }
  }
#endif
  for (; d + kLanes <= D; d += kLanes) {
    vec8 a[R];
    for (int j = 0; j < R; ++j) a[j] = load8(acc + j * D + d) * alpha[j];
    for (int64_t t = 0; t < n; ++t) {
      const vec8 v = load8(vb + t * D + d);
      for (int j = 0; j < R; ++j) a[j] += p[j * kpad + t] * v;
    }
    for (int j = 0; j < R; ++j) store8(acc + j * D + d, a[j]);
  }
  for (; d < D; ++d) {                                      // head_dim not a multiple of kLanes
    for (int j = 0; j < R; ++j) {
      float a = acc[j * D + d] * alpha[j];
      for (int64_t t = 0; t < n; ++t) a += p[j * kpad + t] * vb[t * D + d];
      acc[j * D + d] = a;
    }
  }
}

// Runs f.template operator()<R>(i) over rows i = 0, R, 2R, ... of nq, kRows at a time, then the rest.
template <typename F>
inline void for_row_groups(int64_t nq, F&& f) {
  int64_t i = 0;
  for (; i + kRows <= nq; i += kRows) f.template operator()<kRows>(i);
  switch (nq - i) {
    case 3: f.template operator()<3>(i); break;
    case 2: f.template operator()<2>(i); break;
    case 1: f.template operator()<1>(i); break;
    default: break;
  }
}

}  // namespace streamgate::cpu
