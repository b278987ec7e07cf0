// Vector helpers shared by the CPU kernels: eight fp32 lanes (one AVX2 register) through
// GCC/Clang vector extensions, so the same code is NEON elsewhere; sum8 with AVX2 only.
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace streamgate::cpu {

constexpr int64_t kLanes = 8;        // fp32 lanes of one vector (AVX2: one register)

typedef float vec8 __attribute__((vector_size(32)));   // GCC/Clang vector extension

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof v); }

#ifdef __AVX2__
// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one vector.
inline __m256 sum8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

}  // namespace streamgate::cpu
