// The block-row loop shared by the weight-streaming linear kernels (linear_bf16.cpp,
// linear_int8.cpp): weights packed once at load in blocks of 16 outputs, K-major, each packed
// row holding kPack consecutive k of the block's 16 outputs ([ceil(N/16), ceil(K/kPack), 16,
// kPack]); a row is widened to fp32 lanes in registers by the code type's `widen` and FMA'd
// with the activation, broadcast, accumulating in fp32; an epilogue applies the per-channel
// scale (int8) or none, adds the bias and rounds once to the output's dtype. Blocks are split
// over the threads by parallel.h's loop (OpenMP's, or the elastic pool's chunks: the caller's
// from the front, helpers' from the back); each thread's blocks are one contiguous stream.
//
// A code type is a struct with `code_t`, `kPack` and `static lanes_t widen(const code_t* row,
// int sub, int part)` (lanes `part` of k-sub-index `sub` of one packed row).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "parallel.h"
#include "simd.h"

#include <algorithm>
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

// The epilogue: y[row, n0 + n] = sum[n] * scale[n0 + n] + bias[n0 + n], rounded once to T
// (scale and bias optional).
template <typename T>
struct Out {
  T* y;
  int64_t ys;
  const float* scale;
  const float* bias;
  inline void store(int64_t row, int64_t n0, const float* sum, int64_t valid) const {
    for (int64_t n = 0; n < valid; ++n) {
      const float v = scale ? sum[n] * scale[n0 + n] : sum[n];
      y[row * ys + n0 + n] = static_cast<T>(v + (bias ? bias[n0 + n] : 0.0f));
    }
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

// Rows m..m+R-1 of x (fp32, row stride xs) against one block: U accumulators per row over
// the packed rows. Not inlined: inside parallel_for's lambda GCC kept the accumulators on the
// stack (a store and a reload per FMA, 3x slower). Hint: a software prefetch 4 KB ahead in the
// stream with that locality (kNoPrefetch: none); see stream_prefetch_hint().
template <class Code, int R, int U, int Hint, typename T>
__attribute__((noinline)) void block_rows(const float* x, int64_t xs, const typename Code::code_t* block, int64_t K,
                                          const Out<T>& out, int64_t row, int64_t n0, int64_t valid) {
  constexpr int P = Code::kPack;
  constexpr int64_t kRow = kBlock * P;             // codes per packed row
  const int64_t full = K / P;                     // packed rows whose k all exist
  lanes_t acc[U][R][kParts];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < R; ++j)
      for (int p = 0; p < kParts; ++p) acc[u][j][p] = lanes_t{};
  int64_t r = 0;
  for (; r + U <= full; r += U) {
    if constexpr (Hint != kNoPrefetch)
      __builtin_prefetch(block + (r + 4096 / (kRow * sizeof(typename Code::code_t))) * kRow, 0, Hint);
    for (int u = 0; u < U; ++u)
      for (int s = 0; s < P; ++s)
        for (int p = 0; p < kParts; ++p) {
          const lanes_t w = Code::widen(block + (r + u) * kRow, s, p);
          for (int j = 0; j < R; ++j) acc[u][j][p] += x[j * xs + (r + u) * P + s] * w;
        }
  }
  for (; r * P < K; ++r)                          // the k tail (and a last, partly zero row)
    for (int s = 0; s < P && r * P + s < K; ++s)
      for (int p = 0; p < kParts; ++p) {
        const lanes_t w = Code::widen(block + r * kRow, s, p);
        for (int j = 0; j < R; ++j) acc[0][j][p] += x[j * xs + r * P + s] * w;
      }
  for (int j = 0; j < R; ++j) {
    float tmp[kBlock];
    for (int p = 0; p < kParts; ++p) {
      lanes_t sum = acc[0][j][p];
      for (int u = 1; u < U; ++u) sum += acc[u][j][p];
      std::memcpy(tmp + p * kLanes, &sum, sizeof sum);
    }
    out.store(row + j, n0, tmp, valid);
  }
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

// Splits the blocks over the threads, at least `grain_bytes` of weights per task so small
// layers do not pay for waking a thread; each thread calls f(b) for its blocks in order.
template <class F>
inline void split_blocks(int64_t blocks, int64_t block_bytes, int64_t grain_bytes, F&& f) {
  const int64_t grain = std::max<int64_t>(1, grain_bytes / std::max<int64_t>(1, block_bytes));
  streamgate::cpu::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) f(b);
  });
}

// The FMA path: every block, kFmaRows rows a pass (one widened row shared by them), each row
// with kFmaSplit accumulators over k whatever the pass width, so a row's sum is the same
// sequence of FMAs in a one-row decode as among k verified drafts or other sequences' rows
// (row-invariant: speculative greedy output equals the plain run's). Two chains keep a
// one-row stream ahead of memory; with 16-lane registers 4 rows x 2 fit the 32 of AVX-512,
// with two 8-lane halves (AVX2, 16 registers) passes of 2 rows do.
constexpr int kFmaSplit = 2;
constexpr int kFmaRows = kParts == 1 ? 4 : 2;

template <class Code, int Hint, typename T>
void fma_blocks(const float* xp, int64_t xs, int64_t M, int64_t K, int64_t N, const typename Code::code_t* wp,
                const Out<T>& out, int64_t blocks, int64_t grain_bytes) {
  const int64_t block_codes = (K + Code::kPack - 1) / Code::kPack * Code::kPack * kBlock;
  split_blocks(blocks, block_codes * sizeof(typename Code::code_t), grain_bytes, [&](int64_t b) {
    const auto* block = wp + b * block_codes;
    const int64_t n0 = b * kBlock, valid = std::min(kBlock, N - n0);
    row_groups<kFmaRows>(M, [&](auto r, int64_t m) {
      constexpr int R = decltype(r)::value;
      block_rows<Code, R, kFmaSplit, Hint>(xp + m * xs, xs, block, K, out, m, n0, valid);
    });
  });
}

// Activations as fp32 rows with unit column stride: x itself if it already is, else one
// converted copy (a few rows: cheap next to the weights).
inline torch::Tensor fp32_rows(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat && x.stride(1) == 1 ? x : x.to(torch::kFloat).contiguous();
}

}  // namespace streamgate_linear
