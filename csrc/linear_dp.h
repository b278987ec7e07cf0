// The VDPBF16PS passes of csrc/linear_bf16.cpp's block kernel (the avx512_bf16 variant): bf16
// activations as k-pairs against weights packed [ceil(N/16), ceil(K/2), 16, 2], 8 rows a pass,
// one in-order sum per output; a gate/up weight packed in alternating blocks of 16
// (fused_llama.silu_block) can store silu(gate) * up instead of the two outputs, the GEMM and
// silu_and_mul(block=16) in one pass with the same bits.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "linear_amx.h"
#include "linear_blocks.h"

namespace streamgate_linear {

#if defined(__AVX512BF16__)
constexpr int kDpRows = 8;       // rows per pass over a block (8 accumulators in flight)
// One accumulator per row and output lane, summed over the k-pairs in order, at every pass
// width: a row's sum is then the same sequence of VDPBF16PS whatever rows share its call, so
// a one-row decode and the same position verified among k drafts (or batched beside other
// sequences) give the same bits (speculative greedy output equals the plain run's). Passes of
// 1-3 rows, whose one chain a block would wait on VDPBF16PS's latency, run kDpBlocks(R) blocks
// side by side instead: independent chains over other outputs, each still in k order.
constexpr int kDpBlocks(int R) { return R == 1 ? 4 : R == 2 ? 3 : R == 3 ? 2 : 1; }
// Software prefetch of the weight stream, by pass width and CPU (pass_ahead):
// - Intel's CPUs: prefetcht0 4 KB ahead in every pass, each of a pass's B streams. SmolLM2's
//   one-row bf16 decode step on the Intel AMX host 17.9 -> 16.5-16.7 ms with this and the block
//   tails below (2 threads, builds alternating, 2026-12-05), most of it the prefetch (switched
//   off alone: +0.8-1.2 ms); the layers' one-row calls then read ~21 GB/s against ~19.
// - Others, passes of 1-3 rows: the hardware prefetchers alone. They stream as fast as the memory
//   allows (prefetchnta cost the shift+FMA form's one-row stream ~20 % on the Zen 4 host,
//   2026-12-02; prefetcht1 16 KB ahead was level with none, 2026-12-06).
// - Others, passes of 4+ rows: prefetcht1 (into L2) 16 KB ahead. Their 8 VDPBF16PS a packed row
//   keep the core busy ~60 % of the time the memory takes, and an L1 prefetch 4 KB ahead kept too
//   few lines in flight meanwhile. Zen 4 host, 2026-12-06, variants alternating in one process:
//   236 MB of 8-row passes on 2 threads read 23.6-26.6 GB/s with prefetcht0 4 KB ahead, 26.0-33.5
//   with prefetcht1 16-32 KB ahead (one-row passes: 28.7-38.1); SmolLM2 bf16 decode steps
//   (elastic pool) 18.46 -> 17.07 ms at 8 rows, 15.51 -> 14.94 at 4, 28.43 -> 26.60 at 16; a
//   prefill step (a 286-token chunk beside 7 decode rows) level (191.0 / 190.3 ms).
// - Calls of several passes (9+ rows), off Intel: the passes over a group after its first read it
//   from L2, and meanwhile bring the thread's next group into L2 (prefetcht1, side_of: the next
//   group's bytes cut evenly over the passes and the calls), so that group's first pass does not
//   wait on memory with its compute idle; then only the thread's first group's first pass
//   prefetches ahead of itself. Zen 4 host, 2026-12-06, variants alternating in one process
//   (SmolLM2's 120 layer linears, 30 x 4 shapes, weights cold, 2 threads, medians of 12):
//   16 / 24 / 32 / 48 / 64 rows 15.30 -> 14.68, 20.08 -> 18.54, 22.79 -> 23.25, 32.09 -> 30.36,
//   42.91 -> 41.16 ms (an earlier build: 14.77 -> 13.51, 19.76 -> 18.47, 24.58 -> 23.30, 33.63 ->
//   32.67 at 16-48); the bf16 decode step, steps alternating, 23.39 -> 22.93 ms at 16 rows,
//   42.10 -> 41.33 at 32, 71.79 -> 70.55 at 48. Passes of 16 rows instead of 8 were slower
//   (16.08 / 24.87 / 47.98 ms at 16 / 32 / 64 rows).
enum class Ahead { kNone, kT0Near, kT1Far };
constexpr int64_t kAheadNear = 64, kAheadFar = kFarAheadBytes / 64;  // packed rows of 64 B: 4 KB, 16 KB

// The prefetch ahead of a pass of R rows on this CPU (above), `next` its place in the call.
inline Ahead pass_ahead(int R, const NextGroup& next) {
  if (streamgate::cpu::intel_cpu()) return Ahead::kT0Near;
  if (next.passes > 1 && !(next.cold && next.pass == 0)) return Ahead::kNone;   // side_of's instead
  return R >= 4 ? Ahead::kT1Far : Ahead::kNone;
}

// The lines of the thread's next group that a pass's call over blocks [b, b + w) of group [g0,
// g1) prefetches into L2 (above): share `next.pass` of next.passes of that group's bytes, and of
// it the part that blocks [b, b + w) are of the group. Units: blocks of block_bytes from wp.
struct Side {
  const char* p = nullptr;
  int64_t lines = 0;
};
inline Side side_of(const uint16_t* wp, int64_t block_bytes, const NextGroup& next, int64_t g0, int64_t g1,
                    int64_t b, int64_t w) {
  if (next.b1 <= next.b0 || streamgate::cpu::intel_cpu()) return {};
  const int64_t start = next.b0 * block_bytes, len = (next.b1 - next.b0) * block_bytes;
  const int64_t s0 = start + len * next.pass / next.passes, s1 = start + len * (next.pass + 1) / next.passes;
  const int64_t a = (s0 + (s1 - s0) * (b - g0) / (g1 - g0)) / 64 * 64, e = s0 + (s1 - s0) * (b + w - g0) / (g1 - g0);
  return {reinterpret_cast<const char*>(wp) + a, (e - a + 63) / 64};
}

// Rows row..row+R-1 of x as bf16 k-pairs (one 32-bit word each, row stride xs words) against
// B consecutive blocks of K2 packed pair rows from `block` (outputs n0..n0+16B-1, of N): one
// accumulator per row and block, VDPBF16PS with the pair broadcast; `side` lines from side_of
// prefetched into L2 spread over the packed rows. Not inlined, as tile_rows (linear_blocks.h).
// Silu: the blocks are pairs, a gate block then its up block, and out.y [.., N / 2] gets
// silu(gate) * up, each rounded as the two outputs and silu_and_mul(block=16) round them.
template <int R, int B, bool Silu = false, typename T>
__attribute__((noinline)) void dp_rows(const uint16_t* x, int64_t xs, const uint16_t* block, int64_t K2,
                                       const Out<T>& out, int64_t row, int64_t n0, int64_t N, Ahead ahead,
                                       Side side = {}) {
  const int64_t stride = K2 * 2 * kBlock;          // codes per block
  __m512 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < R; ++j) acc[b][j] = _mm512_setzero_ps();
  auto pair = [&](int j, int64_t r) {
    int32_t v;
    std::memcpy(&v, x + 2 * (j * xs + r), sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
  };
  int64_t side_due = 0;                            // side.lines per K2 packed rows
  for (int64_t r = 0; r < K2; ++r) {
    if (side.lines)
      for (side_due += side.lines; side_due >= K2; side_due -= K2, side.p += 64) _mm_prefetch(side.p, _MM_HINT_T1);
    if (ahead == Ahead::kT0Near)
      for (int b = 0; b < B; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(block + b * stride + (r + kAheadNear) * 2 * kBlock), _MM_HINT_T0);
    else if (ahead == Ahead::kT1Far)
      for (int b = 0; b < B; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(block + b * stride + (r + kAheadFar) * 2 * kBlock), _MM_HINT_T1);
    for (int b = 0; b < B; ++b) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(block + b * stride + r * 2 * kBlock);
      for (int j = 0; j < R; ++j) acc[b][j] = _mm512_dpbf16_ps(acc[b][j], w, pair(j, r));
    }
  }
  if constexpr (Silu) {
    static_assert(B % 2 == 0 && std::is_same_v<T, c10::BFloat16>);
    for (int b = 0; b < B; b += 2)
      for (int j = 0; j < R; ++j) {
        float c[2 * kBlock];
        _mm512_storeu_ps(c, acc[b][j]);
        _mm512_storeu_ps(c + kBlock, acc[b + 1][j]);
        streamgate::cpu::store_tile_rows_silu(c, 1, out.bias ? out.bias + n0 + b * kBlock : nullptr,
                                              out.y + (row + j) * out.ys + (n0 + b * kBlock) / 2, out.ys);
      }
    return;
  }
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < R; ++j) {
      float tmp[kBlock];
      _mm512_storeu_ps(tmp, acc[b][j]);
      out.store(row + j, n0 + b * kBlock, tmp, std::min(kBlock, N - n0 - b * kBlock));
    }
}

// x bf16 [M, K] -> its rows as k-pairs: x itself where the pairs are whole words (unit
// column stride, even K and row stride), else a copy zero-padded to an even K.
inline torch::Tensor bf16_pairs(const torch::Tensor& x) {
  const int64_t K = x.size(1);
  if (x.stride(1) == 1 && K % 2 == 0 && x.stride(0) % 2 == 0) return x;
  auto padded = torch::zeros({x.size(0), K + K % 2}, x.options());
  padded.narrow(1, 0, K).copy_(x);
  return padded;
}

// Every block in 8-row passes over pass_groups' groups (linear_blocks.h), kDpBlocks(R) blocks
// side by side; a group's last blocks, fewer than that, still run side by side (3 or 2), not one
// at a time: one block is one stream, waiting on memory alone. The same sums either way (each
// block's chain in k order).
template <typename T>
inline void dp_blocks(const uint16_t* xp, int64_t xs, int64_t M, int64_t K2, int64_t N, const uint16_t* wp,
               const Out<T>& out, int64_t blocks) {
  const int64_t block_bytes = std::max<int64_t>(1, K2 * 2 * kBlock * 2);     // K = 0: no division by 0
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / block_bytes);
  pass_groups<kDpRows>(M, blocks, block_bytes, grain, [&](auto r, int64_t m, int64_t g0, int64_t g1, const NextGroup& next) {
    constexpr int R = decltype(r)::value;
    const Ahead ahead = pass_ahead(R, next);
    row_groups<kDpBlocks(R)>(g1 - g0, [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      const int64_t b = g0 + i;
      dp_rows<R, W>(xp + m * xs * 2, xs, wp + b * K2 * 2 * kBlock, K2, out, m, b * kBlock, N, ahead,
                    side_of(wp, block_bytes, next, g0, g1, b, W));
    });
  });
}

// dp_blocks for a gate/up weight in alternating blocks of 16 (N % 32 == 0), storing silu(gate) *
// up into out.y [M, N / 2]: pairs of blocks split over the threads, two pairs side by side in
// passes of 1-2 rows, one pair (two chains) in wider ones. The same sums as dp_blocks.
inline void dp_blocks_silu(const uint16_t* xp, int64_t xs, int64_t M, int64_t K2, int64_t N, const uint16_t* wp,
                           const Out<c10::BFloat16>& out) {
  const int64_t pair_bytes = std::max<int64_t>(1, K2 * 2 * kBlock * 2) * 2;
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / pair_bytes);
  pass_groups<kDpRows>(M, N / (2 * kBlock), pair_bytes, grain, [&](auto r, int64_t m, int64_t p0, int64_t p1,
                                                                   const NextGroup& next) {
    constexpr int R = decltype(r)::value;
    const Ahead ahead = pass_ahead(R, next);
    row_groups<R <= 2 ? 2 : 1>(p1 - p0, [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      const int64_t b = 2 * (p0 + i);
      dp_rows<R, 2 * W, true>(xp + m * xs * 2, xs, wp + b * K2 * 2 * kBlock, K2, out, m, b * kBlock, N, ahead,
                              side_of(wp, pair_bytes, next, p0, p1, p0 + i, W));
    });
  });
}
#endif

}  // namespace streamgate_linear
