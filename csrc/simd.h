// Vector helpers shared by the CPU kernels: eight fp32 lanes (one AVX2 register) through
// GCC/Clang vector extensions, so the same code is NEON elsewhere; sum4 with AVX2 only; the exp
// of the softmax and of SiLU.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef __AVX__
#include <immintrin.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace streamgate::cpu {

constexpr int64_t kLanes = 8;        // fp32 lanes of one vector (AVX2: one register)

// Whether this is an Intel CPU: which software prefetch measured gains differs by vendor (the
// Intel AMX host: prefetcht0 4 KB ahead in the weight streams and the span walk; the Zen 4 host:
// none in memory-bound streams, prefetcht1 16 KB ahead where compute shares the stream's time,
// loads for the span walk), so the kernels choose by vendor (linear_dp.h, linear_vnni.h,
// linear_blocks.h; attention_loads.h by vendor and AMX, as the Intel Ice Lake host's span walk
// measured loads ahead). Probed once.
inline bool intel_cpu() {
  static const bool intel = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return static_cast<bool>(__builtin_cpu_is("intel"));
#else
    return false;
#endif
  }();
  return intel;
}

// Whether the CPU has AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24 and 22; whether this process
// may use them is attention_amx.h's amx_supported(), which asks this first). Probed once.
inline bool cpu_has_amx() {
  static const bool amx = [] {
#if defined(__x86_64__)
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 24) & 1u) && ((d >> 22) & 1u);
#else
    return false;
#endif
  }();
  return amx;
}

typedef float vec8 __attribute__((vector_size(32)));   // GCC/Clang vector extension
typedef int32_t vec8i __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof v); }

// Sixteen fp32 lanes (one AVX-512 register), for the loops that run wider where the build has
// AVX-512 (the softmax and SiLU's exp); elsewhere GCC splits them into narrower registers.
typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t vec16i __attribute__((vector_size(64)));

template <typename V>
constexpr int lanes_of = static_cast<int>(sizeof(V) / sizeof(float));

// Grows a thread's reused buffer to at least n elements (never shrinks it).
template <class Vec>
inline void at_least(Vec& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// Horizontal max and sum of a vector's lanes as a tree of halves: log2(lanes) vector steps, where
// a loop over the lanes compiles to one extract and one scalar op a lane (the online softmax's
// two reductions a span were a third of its time, Zen 4 host, 2026-12-06).
typedef float vec4 __attribute__((vector_size(16)));

// v's low and high halves (vec16 -> vec8, vec8 -> vec4), in registers where the build has the
// instructions (the generic split goes through memory).
template <typename V, typename H>
inline void halves(V v, H& lo, H& hi) {
  static_assert(sizeof(V) == 2 * sizeof(H));
#ifdef __AVX512F__
  if constexpr (sizeof(V) == 64) {
    const __m512d x = reinterpret_cast<__m512d>(v);
    lo = reinterpret_cast<H>(_mm512_castpd512_pd256(x)), hi = reinterpret_cast<H>(_mm512_extractf64x4_pd(x, 1));
    return;
  }
#endif
#ifdef __AVX__
  if constexpr (sizeof(V) == 32) {
    const __m256 x = reinterpret_cast<__m256>(v);
    lo = reinterpret_cast<H>(_mm256_castps256_ps128(x)), hi = reinterpret_cast<H>(_mm256_extractf128_ps(x, 1));
    return;
  }
#endif
  std::memcpy(&lo, &v, sizeof lo), std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
}

inline float hsum_v(vec4 v) { return (v[0] + v[2]) + (v[1] + v[3]); }
inline float hmax_v(vec4 v) { return std::max(std::max(v[0], v[2]), std::max(v[1], v[3])); }
inline float hsum_v(vec8 v);                       // the halves of a vec16 reduce through these
inline float hmax_v(vec8 v);

template <typename V, typename H>
inline float hsum_halves(V v) {
  H lo, hi;
  halves(v, lo, hi);
  return hsum_v(lo + hi);
}

template <typename V, typename H>
inline float hmax_halves(V v) {
  H lo, hi;
  halves(v, lo, hi);
  return hmax_v(lo > hi ? lo : hi);
}

inline float hsum_v(vec8 v) { return hsum_halves<vec8, vec4>(v); }
inline float hmax_v(vec8 v) { return hmax_halves<vec8, vec4>(v); }
inline float hsum_v(vec16 v) { return hsum_halves<vec16, vec8>(v); }
inline float hmax_v(vec16 v) { return hmax_halves<vec16, vec8>(v); }

template <typename V>
inline V load_v(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void store_v(float* p, V v) { std::memcpy(p, &v, sizeof v); }

template <typename V>
inline V iota_v() {                                        // {0, 1, ..., lanes - 1}
  V v{};
  for (int l = 0; l < lanes_of<V>; ++l) v[l] = static_cast<float>(l);
  return v;
}

// exp(x) for x <= 0 (softmax arguments), a whole vector at once (V: vec8 or vec16, VI its int32
// lanes): Cephes' expf, 2^n * p(r) with |r| <= ln2 / 2, relative error ~1e-7. Written on whole
// vectors (GCC/Clang vector extensions) because the scalar form did not vectorize: GCC saw
// control flow in it, and the softmax then cost more than the scores and the values together.
// On AVX-512 registers the floor is one VRNDSCALEPS and 2^n * p one VSCALEFPS (in place of two
// conversions, a compare and a subtract, and a conversion, an add, a shift and a multiply): the
// same values (floor is exact; p * 2^n is rounded once either way, n >= -126), eleven
// instructions instead of seventeen. Zen 4 host, 2026-12-06, bits compared equal, with
// the unmasked softmax passes (attention_softmax.h) against neither, alternating in one process:
// a 512-token first chunk's attention (30 layers) 47.58 -> 44.10 ms, four 256-token chunks over
// 600 176.5 -> 162.4, 32 decode rows over 300-380 tokens 14.70 -> 13.91 (pool in L3: 8.57 -> 7.90).
template <typename V, typename VI>
inline V exp_nonpositive(V x) {
  const V lo = V{} - 87.0f;                                 // 2^-126 is the smallest normal float
  x = x < lo ? lo : x;
  const V fx = x * 1.44269504f + 0.5f;
  V n;
#ifdef __AVX512F__
  if constexpr (sizeof(V) == sizeof(__m512))
    n = reinterpret_cast<V>(_mm512_roundscale_ps(reinterpret_cast<__m512>(fx), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
  else
#endif
  {
    n = __builtin_convertvector(__builtin_convertvector(fx, VI), V);   // toward zero
    n = n > fx ? n - 1.0f : n;                                          // floor
  }
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
#ifdef __AVX512F__
  if constexpr (sizeof(V) == sizeof(__m512))
    return reinterpret_cast<V>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#endif
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline vec8 exp8_nonpositive(vec8 x) { return exp_nonpositive<vec8, vec8i>(x); }

// round(silu(x)) * u, silu(x) = x * sigmoid(x) with e = exp(-|x|): sigmoid is 1 / (1 + e) for
// x >= 0 and e / (1 + e) below; `round` is the storage dtype's rounding of silu (the eager op's
// output). The one vector form of SiLU(gate)·up: layers.cpp's silu_and_mul and the fused
// gate/up epilogue (linear_amx.h) both call it, so both give the same bits.
template <typename V, typename VI, typename Round>
inline V silu_mul_core(V x, V u, Round round) {
  const V one = V{} + 1.0f;
  const V e = exp_nonpositive<V, VI>(x < 0 ? x : -x);
  return round(x * (x >= 0 ? one : e) / (one + e)) * u;
}

// The 16- and 32-bit integer vectors of V's width (bf16 bits and their fp32 widening).
template <typename V> struct Bits;
template <> struct Bits<vec8> {
  typedef uint16_t h __attribute__((vector_size(16)));
  typedef uint32_t w __attribute__((vector_size(32)));
};
template <> struct Bits<vec16> {
  typedef uint16_t h __attribute__((vector_size(32)));
  typedef uint32_t w __attribute__((vector_size(64)));
};

// lanes_of<V> bf16 values from p as fp32 (bf16 is fp32's upper half: a widening shift).
template <typename V>
inline V load_bf16_v(const void* p) {
  typename Bits<V>::h h;
  std::memcpy(&h, p, sizeof h);
  const typename Bits<V>::w bits = __builtin_convertvector(h, typename Bits<V>::w) << 16;
  V v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// x rounded to bf16's precision (nearest even), kept as fp32, a whole vector by integer ops.
template <typename V>
inline V round_bf16_v(V x) {
  typename Bits<V>::w b;
  std::memcpy(&b, &x, sizeof b);
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &b, sizeof x);
  return x;
}
inline vec16 exp16_nonpositive(vec16 x) { return exp_nonpositive<vec16, vec16i>(x); }

#ifdef __AVX512F__
// Sixteen values of any storage dtype as fp32 lanes of one AVX-512 register: the decode rows'
// keys and values (attention_decode.h), the int8 KV rows' quantization (kv_int8.h) and the int8
// linears' activation rows (linear_vnni.h).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {          // bf16 is fp32's upper half
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

inline __m512 load16(const double* p) {                 // for completeness: fp64 pools are tests only
  const __m256 lo = _mm512_cvtpd_ps(_mm512_loadu_pd(p)), hi = _mm512_cvtpd_ps(_mm512_loadu_pd(p + 8));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load16(const int8_t* p) {                 // an int8 pool's values, unscaled
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

#ifdef __AVX2__
// [sum(a[0]), ..., sum(a[3])]: four horizontal sums in one 128-bit vector.
inline __m128 sum4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

}  // namespace streamgate::cpu
