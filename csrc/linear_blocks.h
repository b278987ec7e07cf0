// The block-row loop shared by the weight-streaming linear kernels (linear_bf16.cpp,
// linear_int8.cpp): weights packed once at load in blocks of 16 outputs, K-major, each packed
// row holding kPack consecutive k of the block's 16 outputs ([ceil(N/16), ceil(K/kPack), 16,
// kPack]); a row is widened to fp32 lanes in registers by the code type's `widen` and FMA'd
// with the activation, broadcast, accumulating in fp32; an epilogue applies the per-channel
// scale (int8) or none, adds the bias and rounds once to the output's dtype. Blocks are split
// over the threads by parallel.h's loop (OpenMP's, or the elastic pool's chunks: the caller's
// from the front, helpers' from the back); each thread's blocks are one contiguous range, read
// a few blocks side by side (fma_blocks' tiles).
//
// A code type is a struct with `code_t`, `kPack` and `static lanes_t widen(const code_t* row,
// int sub, int part)` (lanes `part` of k-sub-index `sub` of one packed row).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace streamgate_linear {

constexpr int64_t kBlock = 16;   // outputs per packed block, as in linear.cpp

// A block's sixteen lanes are kParts vectors of kLanes fp32: one AVX-512 register, or two
// 8-lane ones (AVX2 registers; GCC/Clang vector extensions elsewhere).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
typedef float lanes_t __attribute__((vector_size(64)));
#else
constexpr int kLanes = 8;
typedef float lanes_t __attribute__((vector_size(32)));
#endif
constexpr int kParts = kBlock / kLanes;

// acc + x * w as one fused multiply-add, by name where the ISA has one: a contracted `acc += x * w`
// is left to the compiler, which may split a lone chain into a multiply and an add (GCC's
// avoid-fma-chains tuning for some CPUs), and a row's bits must not depend on how many chains
// share its pass. Without FMA (x86-64-v2, the fallback build) it is a multiply and an add always.
inline lanes_t fma_lanes(float x, lanes_t w, lanes_t acc) {
#if defined(__AVX512F__)
  return reinterpret_cast<lanes_t>(_mm512_fmadd_ps(_mm512_set1_ps(x), reinterpret_cast<__m512>(w),
                                                   reinterpret_cast<__m512>(acc)));
#elif defined(__FMA__) && defined(__AVX2__)
  return reinterpret_cast<lanes_t>(_mm256_fmadd_ps(_mm256_set1_ps(x), reinterpret_cast<__m256>(w),
                                                   reinterpret_cast<__m256>(acc)));
#else
  return acc + x * w;
#endif
}

// The epilogue: y[row, n0 + n] = sum[n] * scale[n0 + n] + bias[n0 + n], rounded once to T
// (scale and bias optional; with a scale one fused multiply-add, so the bits do not depend on the
// compiler's contraction). A whole block's sixteen are rounded as vectors (bf16 to nearest even
// by integer ops, NaN as c10's 0x7fc0: the bits of c10::BFloat16(float)); a last partial block,
// value by value.
template <typename T>
struct Out {
  T* y;
  int64_t ys;
  const float* scale;
  const float* bias;
  inline void store(int64_t row, int64_t n0, const float* sum, int64_t valid) const {
    T* dst = y + row * ys + n0;
    if (valid < kBlock) {
      for (int64_t n = 0; n < valid; ++n) dst[n] = static_cast<T>(value(sum, n0, n));
      return;
    }
    float v[kBlock];
    for (int n = 0; n < kBlock; ++n) v[n] = value(sum, n0, n);
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      uint16_t h[kBlock];
      for (int n = 0; n < kBlock; ++n) {
        uint32_t b;
        std::memcpy(&b, v + n, sizeof b);
        h[n] = v[n] != v[n] ? uint16_t{0x7fc0} : static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
      }
      std::memcpy(dst, h, sizeof h);
    } else {
      for (int n = 0; n < kBlock; ++n) dst[n] = static_cast<T>(v[n]);
    }
  }
  inline float value(const float* sum, int64_t n0, int64_t n) const {
    const float b = bias ? bias[n0 + n] : 0.0f;
    return scale ? std::fma(sum[n], scale[n0 + n], b) : sum[n] + b;
  }
};

// Software prefetch of the weight stream, 4 KB ahead: the locality __builtin_prefetch takes
// (0: prefetchnta, 3: prefetcht0), or none. For int8 codes prefetchnta measured a gain on the
// Zen 4 host (2026-12-02); on the Intel AMX host it left the stream at ~11 GB/s, as slow as none
// at all, while prefetcht0 took SmolLM2's 120 int8 linears from 9.6 to 4.7-6.5 ms (2 threads,
// weights cold) and the one-row int8 decode step from 16.1 to 13.5 ms (2026-12-04). bf16's block
// kernel measured a ~20 % loss with prefetchnta (Zen 4) and passes kNoPrefetch.
constexpr int kNoPrefetch = -1, kPrefetchNta = 0, kPrefetchT0 = 3;

// How far ahead the AVX-512 passes whose compute shares the stream's time (linear_dp.h's 4+-row
// bf16 passes, linear_vnni.h's 1-3-row int8 ones) prefetch into L2 on CPUs other than Intel's.
constexpr int64_t kFarAheadBytes = 16 << 10;

// The int8 stream's hint on this CPU: prefetcht0 on Intel's, prefetchnta elsewhere.
inline int stream_prefetch_hint() { return streamgate::cpu::intel_cpu() ? kPrefetchT0 : kPrefetchNta; }

// Rows m..m+R-1 of x (fp32, row stride xs) against C blocks side by side (block_codes codes
// apart): one fp32 chain per row and output over k in order, whatever R and C, so a row's sum is
// the same sequence of FMAs in a one-row decode as among verified drafts or other sequences' rows
// (row-invariant: speculative greedy output equals the plain run's). Each packed row of the C
// blocks is widened once and FMA'd with R broadcast activations; sums [R][C * 16] fp32 for the
// caller's epilogue. Not inlined: inside parallel_for's lambda GCC kept the accumulators on the
// stack (a store and a reload per FMA, 3x slower). Hint: a software prefetch 4 KB ahead in each
// block's stream, once a cache line, with that locality (kNoPrefetch: none); see stream_prefetch_hint().
template <class Code, int R, int C, int Hint>
__attribute__((noinline)) void tile_rows(const float* x, int64_t xs, const typename Code::code_t* block,
                                         int64_t block_codes, int64_t K, float* sums) {
  using code_t = typename Code::code_t;
  constexpr int P = Code::kPack;
  constexpr int64_t kRow = kBlock * P;             // codes per packed row
  constexpr int64_t kLine = std::max<int64_t>(1, 64 / (kRow * sizeof(code_t)));  // packed rows a line
  const int64_t full = K / P;                     // packed rows whose k all exist
  lanes_t acc[R][C][kParts];
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < kParts; ++p) acc[j][c][p] = lanes_t{};
  // One packed row's k-sub-index s: the C blocks' codes widened, each FMA'd into R rows.
#define STREAMGATE_TILE_STEP(r, s)                                                  \
  for (int c = 0; c < C; ++c)                                                       \
    for (int p = 0; p < kParts; ++p) {                                              \
      const lanes_t w = Code::widen(block + c * block_codes + (r) * kRow, s, p);    \
      for (int j = 0; j < R; ++j) acc[j][c][p] = fma_lanes(x[j * xs + (r) * P + (s)], w, acc[j][c][p]); \
    }
  for (int64_t r = 0; r < full; ++r) {
    if constexpr (Hint != kNoPrefetch)
      if (r % kLine == 0)
        for (int c = 0; c < C; ++c)
          __builtin_prefetch(block + c * block_codes + r * kRow + 4096 / sizeof(code_t), 0, Hint);
    for (int s = 0; s < P; ++s) STREAMGATE_TILE_STEP(r, s)
  }
  for (int s = 0; s < K - full * P; ++s) STREAMGATE_TILE_STEP(full, s)   // the last, partly zero packed row
#undef STREAMGATE_TILE_STEP
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < kParts; ++p)
        std::memcpy(sums + (j * C + c) * kBlock + p * kLanes, &acc[j][c][p], sizeof(lanes_t));
}

// Calls f(std::integral_constant<int, R>{}, m) for rows m..m+R-1 covering 0..M-1: passes of
// Max rows, then one of the remaining M % Max. (Also blocks side by side: Max at a time, then
// the rest in one call.)
template <int Max, class F>
inline void row_groups(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + Max <= M; m += Max) f(std::integral_constant<int, Max>{}, m);
  if constexpr (Max > 1) {
    if (M - m > 0) row_groups<Max - 1>(M - m, [&](auto r, int64_t m2) { f(r, m + m2); });
  }
}

// Where a pass stands in pass_groups: the thread's next group of blocks [b0, b1) (empty in a call
// of one pass, and after the thread's last group), this pass's index among the group's passes,
// and whether the group is the thread's first (nothing brought it into cache before its first pass).
struct NextGroup {
  int64_t b0 = 0, b1 = 0;
  int pass = 0, passes = 1;
  bool cold = true;
};

// The threads' blocks (at least `grain` a task) for passes of up to Rows rows: f(R, m, g0, g1,
// next) runs the pass of rows m..m+R-1 over blocks [g0, g1). A call of one pass takes each
// thread's blocks as one group; a call of more takes them in groups of ~256 KB (L2-resident),
// every pass over a group before the next, so later passes read the weights from L2, not memory,
// and a pass's rows stay in L1 across the group; `next` lets those passes bring the following
// group into L2 meanwhile (linear_dp.h's side_of).
template <int Rows, class F>
inline void pass_groups(int64_t M, int64_t blocks, int64_t block_bytes, int64_t grain, F&& f) {
  const int64_t group = M <= Rows ? blocks : std::max<int64_t>(1, (256 << 10) / block_bytes);
  const int passes = static_cast<int>((M + Rows - 1) / Rows);
  streamgate::cpu::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t g0 = b0; g0 < b1; g0 += group) {
      const int64_t g1 = std::min(b1, g0 + group);
      NextGroup next{g1, passes > 1 ? std::min(b1, g1 + group) : g1, 0, passes, g0 == b0};
      row_groups<Rows>(M, [&](auto r, int64_t m) {
        f(r, m, g0, g1, static_cast<const NextGroup&>(next));
        ++next.pass;
      });
    }
  });
}

// The FMA path: passes of up to kFmaRows rows over tile_blocks(R) blocks side by side, each
// widened packed row shared by R x C FMAs (the widening, a shuffle and a shift, competes with the
// FMAs for the vector ports: a pass of 4 rows over one block, as before 2026-12-07, left ~100 of a
// core's 166 fp32 GFLOP/s on the Intel Ice Lake host, 75-130 GFLOP/s on two cores at 8-300 rows;
// 8 rows x 3 blocks reach 110-210 of their ~330). Accumulators: R x C x kParts registers, 24 of
// AVX-512's 32, 12 of AVX2's 16 (three 16-output blocks of two 4-lane halves elsewhere). A
// thread's blocks are taken C at a time, every pass over them before the next, so later passes
// read them from L2; row_groups picks a group's tile width (C = the blocks left, at most
// tile_blocks(R)) as it picks a pass's rows.
#if defined(__AVX512F__)
constexpr int kFmaRows = 8;
constexpr int tile_blocks(int R) { return R <= 4 ? 6 : R <= 6 ? 4 : 3; }
#elif defined(__AVX2__)
constexpr int kFmaRows = 6;
constexpr int tile_blocks(int R) { return R == 1 ? 6 : R == 2 ? 3 : R == 3 ? 2 : 1; }
#else                      // 8-lane vectors of two 4-lane registers (SSE's 16, NEON's 32): 12 at most
constexpr int kFmaRows = 3;
constexpr int tile_blocks(int R) { return R == 1 ? 3 : 1; }
#endif

// fp32 weights (linear.cpp's packed blocks [ceil(N/16), K, 16]) as a code type: widening is a load.
struct Fp32Code {
  using code_t = float;
  static constexpr int kPack = 1;
  static inline lanes_t widen(const float* row, int, int p) {
    lanes_t v;
    std::memcpy(&v, row + p * kLanes, sizeof v);
    return v;
  }
};

template <class Code, int Hint, typename T>
void fma_blocks(const float* xp, int64_t xs, int64_t M, int64_t K, int64_t N, const typename Code::code_t* wp,
                const Out<T>& out, int64_t blocks, int64_t grain_bytes) {
  const int64_t block_codes = (K + Code::kPack - 1) / Code::kPack * Code::kPack * kBlock;
  const int64_t group = tile_blocks(static_cast<int>(std::min<int64_t>(M, kFmaRows)));
  const int64_t block_bytes = block_codes * sizeof(typename Code::code_t);
  const int64_t grain = std::max<int64_t>(1, grain_bytes / std::max<int64_t>(1, block_bytes));   // K = 0: bias only
  streamgate::cpu::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t g0 = b0; g0 < b1; g0 += group) {
      row_groups<kFmaRows>(M, [&](auto r, int64_t m) {
        constexpr int R = decltype(r)::value;
        row_groups<tile_blocks(R)>(std::min(group, b1 - g0), [&](auto c, int64_t) {   // one call: at most the width
          constexpr int C = decltype(c)::value;
          float sums[R * C * kBlock];
          tile_rows<Code, R, C, Hint>(xp + m * xs, xs, wp + g0 * block_codes, block_codes, K, sums);
          for (int j = 0; j < R; ++j)
            for (int i = 0; i < C; ++i) {
              const int64_t n0 = (g0 + i) * kBlock;
              out.store(m + j, n0, sums + (j * C + i) * kBlock, std::min(kBlock, N - n0));
            }
        });
      });
    }
  });
}

// Activations as fp32 rows with unit column stride: x itself if it already is, else one
// converted copy (a few rows: cheap next to the weights).
inline torch::Tensor fp32_rows(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat && x.stride(1) == 1 ? x : x.to(torch::kFloat).contiguous();
}

}  // namespace streamgate_linear
