// The inner loops of the paged attention kernel (paged_attention.cpp): scores of a few query
// vectors against a span of keys, and their probabilities times the values, with the
// accumulators in registers; and the exp of the online softmax.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace streamgate::cpu {

constexpr int64_t kRows = 4;         // query vectors per step of the score microkernel

// exp(x) for x <= 0 (softmax arguments), Cephes' expf: 2^n * p(r) with |r| <= ln2 / 2, relative
// error ~1e-7. Plain float code so that `omp simd` loops over it vectorize (std::exp does not).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);                                  // 2^-126 is the smallest normal float
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// S[j, t] = q_j . k_t for R query rows j (R <= kRows) and t < kpad (a multiple of kLanes): a few
// queries times a span of keys as outer products, so that every key vector loaded serves R
// queries, the accumulators stay in registers over d, and nothing is reduced across lanes.
template <int R>
inline void scores_rows(const float* q, const float* kT, float* s, int64_t kpad, int64_t D) {
  int64_t t = 0;
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
// With AVX2, eight keys' dot products are reduced across lanes together.
template <int R>
inline void scores_rows_by_key(const float* q, const float* const* krow, float* s, int64_t kpad, int64_t n, int64_t D) {
  int64_t t = 0;
#ifdef __AVX2__
  if (D % kLanes == 0) {
    for (; t + 8 <= n; t += 8) {
      for (int j = 0; j < R; ++j) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += kLanes) {
          const __m256 qv = _mm256_loadu_ps(q + j * D + d);
          for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krow[t + i] + d), a[i]);
        }
        _mm256_storeu_ps(s + j * kpad + t, sum8(a));
      }
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
