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
#include <type_traits>

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

typedef int8_t i8x16 __attribute__((vector_size(16)));

// Sixteen elements of x as fp32 (bf16 widened by a shift; fp16 converted one by one).
template <typename T>
inline vec16 load16_fp32(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return load_v<vec16>(x);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return load_bf16_v<vec16>(x);
  } else {
    vec16 v;
    for (int l = 0; l < 16; ++l) v[l] = static_cast<float>(x[l]);
    return v;
  }
}

// row[0, D) = the int8 values of x[0, D), row[D, D + 4) = their scale. Sixteen lanes at a time
// (vector extensions, so every kernel variant), the rest one by one, the same arithmetic: the
// division is IEEE's, and 1.5 * 2^23 added and taken away rounds |y| <= 127 half to even.
template <typename T>
inline void quantize_row(const T* x, int8_t* row, int64_t D) {
  const int64_t D16 = D / 16 * 16;
#if defined(__AVX512F__)
  // The same arithmetic on AVX-512 registers by name (GCC's code for the vector form below ran
  // 2.7 ms for 512 tokens' rows over 30 layers): VCVTPS2DQ rounds half to even as the magic does.
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    const auto load = [x](int64_t d) {
      if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(x + d);
      else return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + d))), 16));
    };
    __m512 m = _mm512_setzero_ps();
    for (int64_t d = 0; d < D16; d += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load(d)));
    float amax = _mm512_reduce_max_ps(m);
    for (int64_t d = D16; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
    const float scale = amax / 127.0f;
    if (scale > 0.0f) {
      const __m512 sv = _mm512_set1_ps(scale);
      const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
      for (int64_t d = 0; d < D16; d += 16) {
        const __m512i i = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_div_ps(load(d), sv))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + d), _mm512_cvtepi32_epi8(i));
      }
      for (int64_t d = D16; d < D; ++d)
        row[d] = static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(static_cast<float>(x[d]) / scale))));
      std::memcpy(row + D, &scale, sizeof scale);
    } else {                                       // all zero (or NaN): zeros, scale 0
      std::memset(row, 0, D + kScaleBytes);
    }
    return;
  }
#endif
  vec16 m{};
  for (int64_t d = 0; d < D16; d += 16) {
    const vec16 v = load16_fp32(x + d);
    const vec16 a = v < 0 ? -v : v;
    m = a > m ? a : m;
  }
  float amax = 0.0f;
  for (int l = 0; l < 16; ++l) amax = std::max(amax, m[l]);
  for (int64_t d = D16; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = amax / 127.0f;
  if (!(scale > 0.0f)) {                           // all zero (or NaN): zeros, scale 0
    std::memset(row, 0, D);
    std::memset(row + D, 0, kScaleBytes);
    return;
  }
  const float magic = 12582912.0f;                 // 1.5 * 2^23
  for (int64_t d = 0; d < D16; d += 16) {
    const vec16 r = (load16_fp32(x + d) / scale + magic) - magic;
    vec16i i = __builtin_convertvector(r, vec16i);   // integral already: exact (NaN: INT_MIN, clamped)
    i = i > 127 ? 127 : i;
    i = i < -127 ? -127 : i;
    const i8x16 q = __builtin_convertvector(i, i8x16);
    std::memcpy(row + d, &q, sizeof q);
  }
  for (int64_t d = D16; d < D; ++d)                // fmin/fmax: a NaN element becomes -127, not UB
    row[d] = static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(static_cast<float>(x[d]) / scale))));
  std::memcpy(row + D, &scale, sizeof scale);
}

// out[0, D) = row's values times its scale, in T (fp32 exact; bf16 rounded to nearest even once,
// sixteen lanes at a time as c10::BFloat16 rounds a finite value; fp16 one by one).
template <typename T>
inline void dequant_row(const int8_t* row, T* out, int64_t D) {
  const float s = row_scale(row, D);
  int64_t d = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {              // VCVTNEPS2BF16: nearest even, as c10
    const __m512 sv = _mm512_set1_ps(s);
    for (; d + 16 <= D; d += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)))), sv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
    }
  }
#endif
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>) {
    for (; d + 16 <= D; d += 16) {
      i8x16 q;
      std::memcpy(&q, row + d, sizeof q);
      const vec16 x = __builtin_convertvector(q, vec16) * s;
      if constexpr (std::is_same_v<T, float>) {
        store_v(out + d, x);
      } else {
        typename Bits<vec16>::w b;
        std::memcpy(&b, &x, sizeof b);
        const typename Bits<vec16>::h h = __builtin_convertvector((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16,
                                                                  typename Bits<vec16>::h);
        std::memcpy(out + d, &h, sizeof h);
      }
    }
  }
  for (; d < D; ++d) out[d] = static_cast<T>(static_cast<float>(row[d]) * s);
}

}  // namespace streamgate::cpu
