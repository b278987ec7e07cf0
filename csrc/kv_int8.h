// The int8 KV cache's rows (EngineConfig.kv_cache_dtype "int8", engine/kv_cache.py): each
// (slot, KV head) row of a pool is head_dim int8 values followed by their fp32 scale, so a
// pool is int8 [slots, H_kv, head_dim + 4] and a block's scales travel with its values (swap,
// copy and prefix sharing need nothing more). Symmetric, one scale per token and head:
//   scale = max|x| / 127,  q = round_half_even(x / scale) clamped to [-127, 127]  (0 if scale is 0)
// exactly as engine/kv_cache.py's torch fallback computes it (fp32 division, the same rounding),
// so both write the same bytes. Read back as q * scale in fp32.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace streamgate::cpu {

constexpr int64_t kScaleBytes = 4;   // the fp32 scale after a row's head_dim int8 values

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// row[0, D) = the int8 values of x[0, D), row[D, D + 4) = their scale (zeros and scale 0 for an
// all-zero or NaN row). With AVX-512 sixteen lanes at a time: VCVTPS2DQ rounds half to even after
// IEEE's division (GCC's code for a vector-extension form ran 2.7 ms for 512 tokens' rows over
// 30 layers, this 1.75); elsewhere, and for a head_dim's tail, one value at a time, the same
// arithmetic.
template <typename T>
inline void quantize_row(const T* x, int8_t* row, int64_t D) {
  int64_t d16 = 0;                                  // values done sixteen at a time
  float amax = 0.0f;
#if defined(__AVX512F__)
  d16 = D / 16 * 16;
  __m512 m = _mm512_setzero_ps();
  for (int64_t d = 0; d < d16; d += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x + d)));
  amax = _mm512_reduce_max_ps(m);
#endif
  for (int64_t d = d16; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = amax / 127.0f;
  if (!(scale > 0.0f)) {
    std::memset(row, 0, D + kScaleBytes);
    return;
  }
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(scale);
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  for (int64_t d = 0; d < d16; d += 16) {
    const __m512i i = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_div_ps(load16(x + d), sv))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + d), _mm512_cvtepi32_epi8(i));
  }
#endif
  for (int64_t d = d16; d < D; ++d)                 // fmin/fmax: a NaN element becomes -127, not UB
    row[d] = static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(static_cast<float>(x[d]) / scale))));
  std::memcpy(row + D, &scale, sizeof scale);
}

// out[0, D) = row's values times its scale, rounded once to bf16 (nearest even, as c10 rounds a
// finite value): the VDPBF16PS and AMX tiles' copy of a span (VCVTNEPS2BF16 in their build).
inline void dequant_row_bf16(const int8_t* row, c10::BFloat16* out, int64_t D) {
  const float s = row_scale(row, D);
  int64_t d = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  const __m512 sv = _mm512_set1_ps(s);
  for (; d + 16 <= D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(load16(row + d), sv))));
#endif
  for (; d < D; ++d) out[d] = c10::BFloat16(static_cast<float>(row[d]) * s);
}

}  // namespace streamgate::cpu
