// Vector helpers shared by the CPU kernels: eight fp32 lanes (one AVX2 register) through
// GCC/Clang vector extensions, so the same code is NEON elsewhere; sum4 with AVX2 only; the exp
// of the softmax and of SiLU.
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

// exp(x) for x <= 0 (softmax arguments), eight lanes at once: Cephes' expf, 2^n * p(r) with
// |r| <= ln2 / 2, relative error ~1e-7. Written on whole vectors (GCC/Clang vector extensions)
// because the scalar form did not vectorize: GCC saw control flow in it, and the softmax then
// cost more than the scores and the values together.
inline vec8 exp8_nonpositive(vec8 x) {
  const vec8 lo = vec8{} - 87.0f;                           // 2^-126 is the smallest normal float
  x = x < lo ? lo : x;
  const vec8 fx = x * 1.44269504f + 0.5f;
  vec8 n = __builtin_convertvector(__builtin_convertvector(fx, vec8i), vec8);   // toward zero
  n = n > fx ? n - 1.0f : n;                                // floor
  const vec8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec8 p = vec8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vec8i bits = (__builtin_convertvector(n, vec8i) + 127) << 23;
  vec8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef __AVX2__
// [sum(a[0]), ..., sum(a[3])]: four horizontal sums in one 128-bit vector.
inline __m128 sum4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

}  // namespace streamgate::cpu
