// Vector helpers shared by the CPU kernels: eight fp32 lanes (one AVX2 register) through
// GCC/Clang vector extensions, so the same code is NEON elsewhere; sum4 with AVX2 only.
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace streamgate::cpu {

constexpr int64_t kLanes = 8;        // fp32 lanes of one vector (AVX2: one register)

typedef float vec8 __attribute__((vector_size(32)));   // GCC/Clang vector extension
typedef int32_t vec8i __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof v); }

#ifdef __AVX2__
// [sum(a[0]), ..., sum(a[3])]: four horizontal sums in one 128-bit vector.
inline __m128 sum4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

}  // namespace streamgate::cpu
