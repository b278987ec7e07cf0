// int8 weight-only linears for bf16/fp16 activations on integer dot products (AVX512-VNNI):
// y = (x q^T) s + b for the few rows of a decode step, from pack_int8's codes as they are.
//
// linear_blocks.h's FMA path widens every code to fp32 (two instructions for 16) and spends one
// FMA per code and row: at 8 rows that is compute, not the stream of codes, that sets its time.
// Here each activation row is quantized once per call to int16 against its own scale (max|x| /
// 32767: an error under 2^-16 of its largest element, far below the bf16 rounding it already
// carries), split exactly into two unsigned bytes, a = 256 (hi - 128) + lo, and VPDPBUSD takes
// 4 codes x 16 outputs against 4 bytes of a plane in one instruction:
//   sum_k a_k q_k = 256 (sum_k hi_k q_k - 128 sum_k q_k) + sum_k lo_k q_k,
// int32 sums, exact (|sum| < 255 * 127 * K), so a row's result does not depend on the rows
// beside it. A block's 64 bytes of four packed rows (k..k+3, 16 outputs each) are turned into
// VNNI's order (output n's four codes adjacent) by one dword permute and one byte shuffle; sum_k
// q_k is one more VPDPBUSD against ones. Needs K % 4 == 0.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "linear_blocks.h"
#include "simd.h"

namespace streamgate_linear {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using streamgate::cpu::load16;
constexpr bool kVnniBuilt = true;
constexpr int kVnniRows = 8;           // rows a pass: 16 accumulators of one block's outputs

// Rows of x as the two byte planes of their int16 codes, and each row's scale.
struct SplitRows {
  std::vector<uint8_t> lo, hi;
  std::vector<float> scale;
};

// x [M, K] (row stride xs, K % 16 == 0 or a scalar tail) -> planes [M, K] and scales [M].
template <typename T>
inline void split_rows(const T* x, int64_t xs, int64_t M, int64_t K, SplitRows& out) {
  out.lo.resize(M * K), out.hi.resize(M * K), out.scale.resize(M);
  const int64_t K16 = K / 16 * 16;
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * xs;
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(row + k)));
    float amax = _mm512_reduce_max_ps(mx);
    for (int64_t k = K16; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(row[k])));
    const float scale = amax / 32767.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    out.scale[m] = scale;
    uint8_t *lo = out.lo.data() + m * K, *hi = out.hi.data() + m * K;
    const __m512 iv = _mm512_set1_ps(inv);
    const __m512i bound = _mm512_set1_epi32(32767), low8 = _mm512_set1_epi32(255), bias = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < K16; k += 16) {
      __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + k), iv));
      a = _mm512_max_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), bound), _mm512_min_epi32(bound, a));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + k), _mm512_cvtepi32_epi8(_mm512_and_si512(a, low8)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_srai_epi32(a, 8), bias)));
    }
    for (int64_t k = K16; k < K; ++k) {
      const int32_t a = std::clamp(static_cast<int32_t>(std::nearbyint(static_cast<float>(row[k]) * inv)), -32767, 32767);
      lo[k] = static_cast<uint8_t>(a & 255);
      hi[k] = static_cast<uint8_t>((a >> 8) + 128);
    }
  }
}

// Four packed rows (64 bytes: k..k+3 x 16 outputs) -> output n's codes k..k+3 in dword n.
inline __m512i vnni_order(__m512i w) {
  const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, w), bytes);
}

inline __m512i bcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// Rows m..m+R-1 against B consecutive blocks (K packed rows of 16 codes each, outputs n0.. of
// N) -> y through `out`, each block's codes prefetched 4 KB ahead (Hint: linear_blocks.h's
// locality, or none). B > 1 keeps that many weight streams in flight for passes of one or two
// rows, which wait on memory alone. Integer sums: exact, the same bits whatever B.
// Where Hint is prefetchnta (CPUs other than Intel's), passes of 1-3 rows prefetch into L2 16 KB
// ahead instead (kFarRows, linear_blocks.h's kFarAheadBytes): their VPDPBUSDs keep the core busy
// about a third of the time the stream takes, and prefetchnta 4 KB ahead left too few lines in
// flight. Zen 4 host, 2026-12-06:
// this loop alone (4 blocks side by side, 236 MB of codes, 2 threads, variants alternating)
// 24.2-28.7 -> 27.8-35.7 GB/s; SmolLM2's int8 decode step (elastic pool, switched every 10
// steps) 9.82 / 10.12 -> 9.31 / 9.74 ms at one row, 9.22 / 10.40 -> 8.32 / 8.89 at two. Passes of
// 8 rows, bound by their VPDPBUSDs, were slower with it (22.4 -> 23.4 ms) and keep prefetchnta.
constexpr bool kFarRows(int R, int Hint) { return Hint == kPrefetchNta && R < 4; }
template <int R, int B, int Hint, typename T>
__attribute__((noinline)) void vnni_block_rows(const SplitRows& xs, int64_t m, int64_t K, const int8_t* block,
                                               const Out<T>& out, int64_t n0, int64_t N) {
  __m512i lo[B][R], hi[B][R], sum[B];
  for (int b = 0; b < B; ++b) {
    sum[b] = _mm512_setzero_si512();
    for (int j = 0; j < R; ++j) lo[b][j] = hi[b][j] = _mm512_setzero_si512();
  }
  const __m512i ones = _mm512_set1_epi8(1);
  const uint8_t* plo = xs.lo.data() + m * K;
  const uint8_t* phi = xs.hi.data() + m * K;
  const int64_t stride = K * kBlock;
  for (int64_t k = 0; k < K; k += 4) {
    for (int b = 0; b < B; ++b) {
      const int8_t* codes = block + b * stride + k * kBlock;
      if constexpr (kFarRows(R, Hint)) _mm_prefetch(reinterpret_cast<const char*>(codes + kFarAheadBytes), _MM_HINT_T1);
      else if constexpr (Hint != kNoPrefetch) __builtin_prefetch(codes + 4096, 0, Hint);
      const __m512i w = vnni_order(_mm512_loadu_si512(codes));
      sum[b] = _mm512_dpbusd_epi32(sum[b], ones, w);
      for (int j = 0; j < R; ++j) {
        lo[b][j] = _mm512_dpbusd_epi32(lo[b][j], bcast4(plo + j * K + k), w);
        hi[b][j] = _mm512_dpbusd_epi32(hi[b][j], bcast4(phi + j * K + k), w);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    const __m512i offset = _mm512_slli_epi32(sum[b], 7);                 // 128 sum_k q_k
    for (int j = 0; j < R; ++j) {
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi[b][j], offset)), _mm512_set1_ps(256.0f),
                                       _mm512_cvtepi32_ps(lo[b][j]));
      float tmp[kBlock];
      _mm512_storeu_ps(tmp, _mm512_mul_ps(v, _mm512_set1_ps(xs.scale[m + j])));
      out.store(m + j, n0 + b * kBlock, tmp, std::min(kBlock, N - n0 - b * kBlock));
    }
  }
}

// Blocks side by side in a pass of R rows: four for one row, two for two, else one. SmolLM2's
// one-row int8 decode step on the Intel AMX host: 11.7-12.3 -> 10.8 ms (2 threads, builds
// alternating, 2026-12-05); eight rows (one block a pass) level.
constexpr int kVnniBlocks(int R) { return R == 1 ? 4 : R == 2 ? 2 : 1; }

// Every block in kVnniRows-row passes over pass_groups' groups (linear_blocks.h), kVnniBlocks(R)
// blocks side by side, then the group's rest in one call.
template <int Hint, typename T>
void vnni_blocks(const SplitRows& xs, int64_t M, int64_t K, int64_t N, const int8_t* wp, const Out<T>& out,
                 int64_t blocks, int64_t grain_bytes) {
  const int64_t block_bytes = std::max<int64_t>(1, K * kBlock);
  const int64_t grain = std::max<int64_t>(1, grain_bytes / block_bytes);
  pass_groups<kVnniRows>(M, blocks, block_bytes, grain, [&](auto r, int64_t m, int64_t g0, int64_t g1, const NextGroup&) {
    constexpr int R = decltype(r)::value;
    row_groups<kVnniBlocks(R)>(g1 - g0, [&](auto width, int64_t i) {
      const int64_t b = g0 + i;
      vnni_block_rows<R, decltype(width)::value, Hint>(xs, m, K, wp + b * K * kBlock, out, b * kBlock, N);
    });
  });
}
#else
constexpr bool kVnniBuilt = false;
#endif

}  // namespace streamgate_linear
