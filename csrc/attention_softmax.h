// The online softmax of the paged attention kernel's spans (attention_tiles.h's loops, the decode
// rows and the query tiles): one query row's scores over a span become probabilities, with the
// running max and the rescale of what was accumulated before.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace streamgate::cpu {

// The two passes of softmax_span over si[t, end), V's lanes at a time while a whole vector
// fits before `end`; `t` is left where they stopped (a multiple of kLanes below end at most).
// Masked: lanes outside [flo, fvis) are ignored by the max and get probability 0; else every
// lane is visible (a span seen whole) and the same operations run without the mask.
template <bool Masked, typename V>
inline float span_max(const float* si, int64_t& t, int64_t end, float flo, float fvis, float acc) {
  constexpr int L = lanes_of<V>;
  const V ninf = V{} - std::numeric_limits<float>::infinity(), lane = iota_v<V>();
  V vmax = ninf;
  for (; t + L <= end; t += L) {
    V x = load_v<V>(si + t);
    if constexpr (Masked) {
      const V at = lane + static_cast<float>(t);
      x = (at < fvis) & (at >= flo) ? x : ninf;
    }
    vmax = x > vmax ? x : vmax;
  }
  return std::max(acc, hmax_v(vmax));
}

template <bool Masked, typename V, typename VI, class Put>
inline float span_exp(const float* si, int64_t& t, int64_t end, float flo, float fvis, float new_m, float acc, Put put) {
  constexpr int L = lanes_of<V>;
  const V zero = {}, lane = iota_v<V>();
  V vsum = {};
  for (; t + L <= end; t += L) {
    V p = exp_nonpositive<V, VI>(load_v<V>(si + t) - new_m);
    if constexpr (Masked) {
      const V at = lane + static_cast<float>(t);
      p = (at < fvis) & (at >= flo) ? p : zero;
    }
    put(t, p);
    vsum += p;
  }
  return acc + hsum_v(vsum);
}

// Both passes over the span, masked or not, sixteen lanes at a time where the build has AVX-512,
// then eight.
template <bool Masked>
inline float span_max_lanes(const float* si, int64_t& t, int64_t end, float flo, float fvis, float acc) {
#ifdef __AVX512F__
  acc = span_max<Masked, vec16>(si, t, end, flo, fvis, acc);
#endif
  return span_max<Masked, vec8>(si, t, end, flo, fvis, acc);
}

template <bool Masked, class Put>
inline float span_exp_lanes(const float* si, int64_t& t, int64_t end, float flo, float fvis, float new_m, float acc, Put put) {
#ifdef __AVX512F__
  acc = span_exp<Masked, vec16, vec16i>(si, t, end, flo, fvis, new_m, acc, put);
#endif
  return span_exp<Masked, vec8, vec8i>(si, t, end, flo, fvis, new_m, acc, put);
}

// Where softmax_span's probabilities go unless told: back into the row of scores.
struct ProbsF32 {
  float* si;
  template <typename V>
  void operator()(int64_t t, V p) const { store_v(si + t, p); }
};

// One query row's span of scores si[0, n) (n <= kpad, si padded to kpad) under the online
// softmax: keys outside [lo, visible) (before the window, past the causal cut) get probability
// 0, the others exp(s - new_m) with new_m = max(m, their max); lo < visible. Returns the
// probabilities' sum; `m` becomes new_m, and `alpha` the factor exp(m_old - new_m) for what
// was accumulated before. Sixteen lanes at a time where the build has AVX-512 (the exp is most
// of a prefill tile's instructions), then eight; the row is padded to a multiple of eight. A span
// seen whole (every decode row's full spans, a query tile's spans below its diagonal) skips the
// lanes' mask (span_max / span_exp unmasked): the same bits. `put(t, p)` stores the
// probabilities t.. (and the zeros, eight at a time to n rounded up to eight): into si unless told.
template <class Put>
inline float softmax_span(const float* si, int64_t n, int64_t visible, float& m, float& alpha, int64_t lo, Put put) {
  const float flo = static_cast<float>(lo), fvis = static_cast<float>(visible);
  const int64_t t0 = lo / kLanes * kLanes, end = (visible + kLanes - 1) / kLanes * kLanes;
  int64_t t = t0;
  const bool whole = lo == 0 && visible == n && end == n;
  const float block_max = whole ? span_max_lanes<false>(si, t, end, flo, fvis, -std::numeric_limits<float>::infinity())
                                : span_max_lanes<true>(si, t, end, flo, fvis, -std::numeric_limits<float>::infinity());
  const float new_m = std::max(m, block_max);
  alpha = m == new_m ? 1.0f : std::exp(m - new_m);          // 0 on the first span; exp(0) is 1 exactly
  m = new_m;
  const vec8 zero = {};
  for (t = 0; t < t0; t += kLanes) put(t, zero);           // before the window
  t = t0;
  const float sum = whole ? span_exp_lanes<false>(si, t, end, flo, fvis, new_m, 0.0f, put)
                          : span_exp_lanes<true>(si, t, end, flo, fvis, new_m, 0.0f, put);
  for (; t < n; t += kLanes) put(t, zero);                // past the cut, to the padded end
  return sum;
}

inline float softmax_span(float* si, int64_t n, int64_t visible, float& m, float& alpha, int64_t lo = 0) {
  return softmax_span(si, n, visible, m, alpha, lo, ProbsF32{si});
}

// One span of a query tile under the online softmax, row by row: row i's scores s + i * kpad
// (keys b0..b0 + n - 1, its query at position qpos[i]) take the causal cut, the layer's window
// and soft cap (Feat: attention_tiles.h's Features) and softmax_span into put_of(i) (ProbsF32,
// or attention_bf16.h's ProbsBf16), and l[i] the span's sum; a row that sees none of the span
// gets probabilities 0 (to n rounded up to eight) and alpha 1. The fp32 tiles' loop and the
// VDPBF16PS tiles' (attention_run.h, attention_tile_bf16.h).
template <class Feat, class PutOf>
inline void softmax_rows(float* s, int64_t kpad, int64_t nq, const int64_t* qpos, int64_t b0, int64_t n,
                         const Feat& f, float* m, float* l, float* alpha, PutOf&& put_of) {
  for (int64_t i = 0; i < nq; ++i) {
    float* si = s + i * kpad;
    const auto put = put_of(i);
    const int64_t visible = std::max<int64_t>(0, std::min(n, qpos[i] + 1 - b0));   // causal cut
    const int64_t lo = std::max<int64_t>(0, f.first_key(qpos[i]) - b0);            // window start
    if (visible <= lo) {
      for (int64_t t = 0; t < n; t += kLanes) put(t, vec8{});
      alpha[i] = 1.0f;
      continue;
    }
    f.cap(si, lo, visible);
    const float sum = softmax_span(si, n, visible, m[i], alpha[i], lo, put);
    l[i] = l[i] * alpha[i] + sum;
  }
}

}  // namespace streamgate::cpu
