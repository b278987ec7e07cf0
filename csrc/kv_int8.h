// The int8 KV cache's rows (EngineConfig.kv_cache_dtype "int8", engine/kv_cache.py): each
// (slot, KV head) row of a pool is head_dim int8 values followed by their fp32 scale, so a
// pool is int8 [slots, H_kv, head_dim + 4] and a block's scales travel with its values (swap,
// copy and prefix sharing need nothing more). Symmetric, one scale per token and head:
//   scale = max|x| / 127,  q = round_half_even(x / scale) clamped to [-127, 127]  (0 if scale is 0)
// exactly as engine/kv_cache.py's torch fallback computes it (fp32 division, the same rounding),
// so both write the same bytes. Read back as q * scale in fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace streamgate::cpu {

constexpr int64_t kScaleBytes = 4;   // the fp32 scale after a row's head_dim int8 values

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// row[0, D) = the int8 values of x[0, D), row[D, D + 4) = their scale.
template <typename T>
inline void quantize_row(const T* x, int8_t* row, int64_t D) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = amax / 127.0f;
  if (!(scale > 0.0f)) {                           // all zero (or NaN): zeros, scale 0
    std::memset(row, 0, D);
    std::memset(row + D, 0, kScaleBytes);
    return;
  }
#pragma omp simd
  for (int64_t d = 0; d < D; ++d)                  // fmin/fmax: a NaN element becomes -127, not UB
    row[d] = static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(static_cast<float>(x[d]) / scale))));
  std::memcpy(row + D, &scale, sizeof scale);
}

// out[0, D) = row's values times its scale, in T (fp32 exact; bf16/fp16 rounded once).
template <typename T>
inline void dequant_row(const int8_t* row, T* out, int64_t D) {
  const float s = row_scale(row, D);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(static_cast<float>(row[d]) * s);
}

}  // namespace streamgate::cpu
