// int8 weight-only and bf16 linear layers on AMX tiles, for steps of more than a few bf16 rows
// (batched decode, a prefill chunk): y = (x q^T) * s + b with the codes widened to bf16 once per
// call into a panel per pair of 16-output blocks (bf16 weights: linear_bf16.cpp's pair-packed
// blocks, read in place), then TDPBF16PS against the activations read as they are (16 x 32 bf16
// tiles straight from x's rows).
//
// Why: linear_int8.cpp's FMA path widens every code for every row and is bound by fp32 FMAs
// above a few rows (SmolLM2's layers at 32 rows: 26 ms a step on two cores of the Intel AMX
// host, linear in the rows), and dequantize + oneDNN costs ~30 ms at any row count (a plain
// weight reordered every call). Here a code is widened once per call however many rows
// share it, and the products run on the tiles.
//
// Exactness: codes are integers in [-127, 127] (exact in bf16: the top half of their fp32),
// x is bf16, so each product is exact in fp32 and sums are fp32, as in the FMA path; only the
// order of the sums differs (TDPBF16PS adds pairs). Scale and bias are applied once at the
// end and the result rounded once to bf16, as the FMA path does. A row's result does not
// depend on the other rows of the call or on the threads (blocks of outputs are split, never
// a sum), but it differs in the last bits from the FMA path's.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "parallel.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "attention_amx.h"
#include "simd.h"

namespace streamgate::cpu {

// A call's activation rows x [M, K] bf16 as the tile loads read them, 16 rows at a time: the
// tile at row r0 from x itself, except a last, partial tile (M % 16 rows), which comes from a
// 16-row copy with zero rows past M. Only that copy is made (x had been copied whole for any M
// not a multiple of 16: ~3 ms of a 512-token mixed step's 140, SmolLM2 on the Intel AMX host).
struct RowTiles {
  const c10::BFloat16* x;
  const c10::BFloat16* tail;      // the last tile's 16 rows, or null when M % 16 == 0
  int64_t tail_row, K;
  const c10::BFloat16* tile(int64_t r0) const { return tail && r0 == tail_row ? tail : x + r0 * K; }
};

// y [M, N] bf16 from `run(rows, M, M16, y)`, M16 = M rounded up to 16 (x copied first only
// where it is not contiguous).
template <typename Run>
inline torch::Tensor on_row_tiles(const torch::Tensor& x, int64_t N, Run run) {
  const int64_t M = x.size(0), K = x.size(1), M16 = (M + 15) / 16 * 16;
  const torch::Tensor xc = x.contiguous();
  const auto* xp = reinterpret_cast<const c10::BFloat16*>(xc.data_ptr<at::BFloat16>());
  // The tail tile in this thread's buffer (one allocation per thread, not four tensor ops a call:
  // ~0.5 ms of an 8-row SmolLM2 decode step's 121 calls).
  thread_local std::vector<c10::BFloat16> tail;
  if (M16 > M) {
    const int64_t valid = M - (M16 - 16);
    if (static_cast<int64_t>(tail.size()) < 16 * K) tail.resize(16 * K);
    std::memcpy(tail.data(), xp + (M16 - 16) * K, valid * K * sizeof(c10::BFloat16));
    std::memset(static_cast<void*>(tail.data() + valid * K), 0, (16 - valid) * K * sizeof(c10::BFloat16));
  }
  const RowTiles rows{xp, M16 > M ? tail.data() : nullptr, M16 - 16, K};
  auto y = torch::empty({M, N}, x.options());
  run(rows, M, M16, reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>()));
  return y;
}

}  // namespace streamgate::cpu

#if defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__)

namespace streamgate::cpu {

constexpr bool kLinearAmxBuilt = true;

// panel[p][j] = the bf16 pair (q[2p][j], q[2p+1][j]) of one packed block (codes [K][16]), as a
// 32-bit word (low half: k = 2p), p < K / 2: AMX's B layout for 16 outputs.
inline void widen_panel(const int8_t* codes, int64_t K, uint32_t* panel) {
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 2 * p * 16));
    const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (2 * p + 1) * 16));
    const __m512i f0 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r0)));
    const __m512i f1 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r1)));
    _mm512_storeu_si512(panel + p * 16, _mm512_or_si512(_mm512_srli_epi32(f0, 16), _mm512_and_si512(f1, hi_mask)));
  }
}

// c[16 * MB rows][32] fp32 (row stride 32) = the 16-row tiles x0 and (MB == 2) x1 (bf16, row
// stride K, K % 32 == 0) times NB panels (NB blocks of 16 outputs). Tiles 0-3 accumulate, 4 and 7 hold
// A, 5 and 6 hold B (attention_amx.h's configuration: 16 rows of 64 bytes each).
// Stream: x's tiles are loaded with the non-temporal hint (TILELOADDT1), so that a pair's panels
// (K x 64 bytes), which every 32-row tile of the call reads again, stay in L1 instead of being
// evicted by activations read once per pair; the same bits. Both tiles together must come from
// L1 for TDPBF16PS to run near its rate: one core of the Intel AMX host made 2.5 TFLOP/s with
// its four tile loads a step from a 32 KB ring and 0.86-1.9 from 256 KB (2026-12-05).
template <int MB, int NB, bool Stream = false>
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_rows_blocks(const c10::BFloat16* x0,
                                                                          const c10::BFloat16* x1, int64_t K,
                                                                          const uint32_t* panel0,
                                                                          const uint32_t* panel1, float* c) {
  asm volatile("" ::: "memory");      // the panel and x stores before the tile loads (attention_amx.h)
  const long xbytes = K * 2;
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (MB == 2) _tile_zero(2);
  if constexpr (MB == 2 && NB == 2) _tile_zero(3);
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    _tile_loadd(5, panel0 + k0 / 2 * 16, 64);
    if constexpr (NB == 2) _tile_loadd(6, panel1 + k0 / 2 * 16, 64);
    if constexpr (Stream) _tile_stream_loadd(4, x0 + k0, xbytes);
    else _tile_loadd(4, x0 + k0, xbytes);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 6);
    if constexpr (MB == 2) {
      if constexpr (Stream) _tile_stream_loadd(7, x1 + k0, xbytes);
      else _tile_loadd(7, x1 + k0, xbytes);
      _tile_dpbf16ps(2, 7, 5);
      if constexpr (NB == 2) _tile_dpbf16ps(3, 7, 6);
    }
  }
  _tile_stored(0, c, 128);
  if constexpr (NB == 2) _tile_stored(1, c + 16, 128);
  if constexpr (MB == 2) _tile_stored(2, c + 16 * 32, 128);
  if constexpr (MB == 2 && NB == 2) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// c[16 rows][64] fp32 (row stride 64) = the 16-row tile x0 times four consecutive panels
// (blocks of 16 outputs at panel0 + i * K/2 * 16 words), for steps of up to 16 rows, which read
// each panel once, from memory: four weight streams in flight instead of a pair's two. Tiles 0-3
// accumulate, 4 holds A, 5 and 6 take the panels in turn; each block's sums are the same
// TDPBF16PS sequence as tile_rows_blocks', so the same bits. SmolLM2's 8-row bf16 decode step on
// the Intel AMX host: 25.2-25.5 -> 22.2-22.8 ms with on_row_tiles' buffer (2 threads, builds
// alternating, 2026-12-05; switched off alone +1 ms); the 49152-output head at 8 rows 2.65 -> 2.3.
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_row_quad(const c10::BFloat16* x0, int64_t K,
                                                                        const uint32_t* panel0, float* c) {
  asm volatile("" ::: "memory");
  const long xbytes = K * 2;
  const int64_t pw = K / 2 * 16;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const uint32_t* p = panel0 + k0 / 2 * 16;
    _tile_loadd(4, x0 + k0, xbytes);
    _tile_loadd(5, p, 64);
    _tile_loadd(6, p + pw, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, p + 2 * pw, 64);
    _tile_loadd(6, p + 3 * pw, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, c, 256);
  _tile_stored(1, c + 16, 256);
  _tile_stored(2, c + 32, 256);
  _tile_stored(3, c + 48, 256);
}

// y[r][n] for r < rows, n in [n0, n0 + width) (width <= 32): bf16(c[r][n - n0] * s[n] + b[n]) (no s: 1).
inline void store_tile_rows(const float* c, int64_t rows, int64_t n0, int64_t width, const float* s, const float* b,
                            c10::BFloat16* y, int64_t ystride, int64_t cstride = 32) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j0 = 0; j0 < width; j0 += 16) {
      const int64_t w = std::min<int64_t>(16, width - j0);
      const __mmask16 mask = static_cast<__mmask16>((1u << w) - 1u);
      __m512 v = _mm512_loadu_ps(c + r * cstride + j0);
      if (s) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, s + n0 + j0));
      if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, b + n0 + j0));
      _mm256_mask_storeu_epi16(y + r * ystride + n0 + j0, mask,
                               reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));   // nearest even
    }
}

// y[r][0, 16) = silu(g) * u for r < rows, rounded as layers.cpp's silu_and_mul rounds it, g and u
// c's two 16-column halves (a gate block and its up block, + bias) rounded to bf16 as
// store_tile_rows would store them: the gate/up GEMM and SiLU·up in one pass over the tile.
inline void store_tile_rows_silu(const float* c, int64_t rows, const float* b, c10::BFloat16* y, int64_t ystride,
                                 int64_t cstride = 32) {
  auto rounded = [](__m512 v) {                          // bf16 (nearest even), widened back
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  for (int64_t r = 0; r < rows; ++r) {
    __m512 g = _mm512_loadu_ps(c + r * cstride), u = _mm512_loadu_ps(c + r * cstride + 16);
    if (b) g = _mm512_add_ps(g, _mm512_loadu_ps(b)), u = _mm512_add_ps(u, _mm512_loadu_ps(b + 16));
    const vec16 o = silu_mul_core<vec16, vec16i>(reinterpret_cast<vec16>(rounded(g)), reinterpret_cast<vec16>(rounded(u)),
                                                  [](vec16 s) { return round_bf16_v(s); });
    const __m512i bits = _mm512_srli_epi32(reinterpret_cast<__m512i>(round_bf16_v(o)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ystride), _mm512_cvtepi32_epi16(bits));
  }
}

// y [M, N] bf16 = x's rows (RowTiles; M16 = M rounded up to 16, K % 32 == 0) times the
// blocks of 16 outputs whose K/2 x 16-word panels `panel(block, buffer)` returns (widened into
// `buffer`, or read in place), scaled by s (none: 1), plus b: pairs of blocks split over threads.
// Silu: each pair of blocks is a gate block and its up block (N % 32 == 0), and y [M, N / 2]
// holds silu(gate) * up (store_tile_rows_silu).
template <bool Widened, typename Panel, bool Silu = false>
inline void amx_linear(const RowTiles& x, int64_t M, int64_t M16, int64_t K, int64_t blocks, int64_t N,
                       const float* s, const float* b, c10::BFloat16* y, Panel panel) {
  const int64_t pairs = (blocks + 1) / 2;
  // Activations streamed past the panels where a pair's panels fit L1 (48 KB) beside a tile's
  // rows and more than one 32-row tile reads them: SmolLM2's K = 576 linears at 288-512 rows
  // 1.15-1.2x on one core of the Intel AMX host; its K = 1536 (panels of 96 KB) 0.97x, so not there.
  const bool stream = M16 > 32 && K * 64 <= 40 * 1024;
  streamgate::cpu::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    AmxScope scope(true);
    // Two panels of K/2 x 16 words where the codes are widened (uninitialized: each is written whole).
    const std::unique_ptr<uint32_t[]> buffers(Widened ? new uint32_t[K * 16] : nullptr);
    alignas(64) float c[32 * 32];
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t blk = 2 * pair, nb = std::min<int64_t>(2, blocks - blk);
      // Up to 16 rows (a decode step) two pairs at a time where the chunk has them: four weight
      // streams in flight, not two (tile_row_quad).
      if (!Widened && M16 == 16 && pair + 1 < p1 && blk + 4 <= blocks) {
        tile_row_quad(x.tile(0), K, panel(blk, nullptr), c);
        for (int h = 0; h < 2; ++h) {
          if constexpr (Silu)
            store_tile_rows_silu(c + 32 * h, M, b ? b + (blk + 2 * h) * 16 : nullptr, y + (pair + h) * 16, N / 2, 64);
          else
            store_tile_rows(c + 32 * h, M, (blk + 2 * h) * 16, std::min<int64_t>(32, N - (blk + 2 * h) * 16), s, b, y, N, 64);
        }
        ++pair;
        continue;
      }
      const uint32_t* panel0 = panel(blk, buffers.get());
      const uint32_t* panel1 = nb == 2 ? panel(blk + 1, buffers.get() + K / 2 * 16) : panel0;
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const bool two_rows = m0 + 16 < M16;
        const c10::BFloat16 *xa = x.tile(m0), *xb = two_rows ? x.tile(m0 + 16) : xa;
        if (two_rows && stream) {
          if (nb == 2) tile_rows_blocks<2, 2, true>(xa, xb, K, panel0, panel1, c);
          else tile_rows_blocks<2, 1, true>(xa, xb, K, panel0, panel1, c);
        } else if (two_rows) {
          if (nb == 2) tile_rows_blocks<2, 2>(xa, xb, K, panel0, panel1, c);
          else tile_rows_blocks<2, 1>(xa, xb, K, panel0, panel1, c);
        } else {
          if (nb == 2) tile_rows_blocks<1, 2>(xa, xb, K, panel0, panel1, c);
          else tile_rows_blocks<1, 1>(xa, xb, K, panel0, panel1, c);
        }
        if constexpr (Silu)
          store_tile_rows_silu(c, std::min<int64_t>(32, M - m0), b ? b + blk * 16 : nullptr, y + m0 * (N / 2) + pair * 16,
                               N / 2);
        else
          store_tile_rows(c, std::min<int64_t>(32, M - m0), blk * 16, std::min<int64_t>(16 * nb, N - blk * 16), s, b,
                          y + m0 * N, N);
      }
    }
  });
}

// int8 codes packed [blocks][K][16] (linear_int8.cpp), widened per call.
inline void linear_int8_amx(const RowTiles& x, int64_t M, int64_t M16, int64_t K, const int8_t* codes,
                            int64_t blocks, int64_t N, const float* s, const float* b, c10::BFloat16* y) {
  amx_linear<true>(x, M, M16, K, blocks, N, s, b, y, [&](int64_t blk, uint32_t* buffer) -> const uint32_t* {
    widen_panel(codes + blk * K * 16, K, buffer);
    return buffer;
  });
}

// bf16 weights packed [blocks][K/2][16][2] (linear_bf16.cpp's AVX512-BF16 layout): already AMX's
// B layout, read in place.
inline void linear_bf16_amx(const RowTiles& x, int64_t M, int64_t M16, int64_t K, const uint32_t* words,
                            int64_t blocks, int64_t N, const float* b, c10::BFloat16* y) {
  amx_linear<false>(x, M, M16, K, blocks, N, nullptr, b, y,
             [&](int64_t blk, uint32_t*) -> const uint32_t* { return words + blk * (K / 2) * 16; });
}

// The same with the fused SiLU·up epilogue: the blocks alternate gate and up (N % 32 == 0), y is
// [M, N / 2].
inline void linear_bf16_amx_silu(const RowTiles& x, int64_t M, int64_t M16, int64_t K, const uint32_t* words,
                                 int64_t blocks, int64_t N, const float* b, c10::BFloat16* y) {
  auto panel = [&](int64_t blk, uint32_t*) -> const uint32_t* { return words + blk * (K / 2) * 16; };
  amx_linear<false, decltype(panel), true>(x, M, M16, K, blocks, N, nullptr, b, y, panel);
}

}  // namespace streamgate::cpu

#else

namespace streamgate::cpu {
constexpr bool kLinearAmxBuilt = false;
inline void linear_int8_amx(const RowTiles&, int64_t, int64_t, int64_t, const int8_t*, int64_t, int64_t,
                            const float*, const float*, c10::BFloat16*) {}
inline void linear_bf16_amx(const RowTiles&, int64_t, int64_t, int64_t, const uint32_t*, int64_t, int64_t,
                            const float*, c10::BFloat16*) {}
inline void linear_bf16_amx_silu(const RowTiles&, int64_t, int64_t, int64_t, const uint32_t*, int64_t, int64_t,
                                 const float*, c10::BFloat16*) {}
}  // namespace streamgate::cpu

#endif

namespace streamgate::cpu {

// Whether a step of x's rows runs on these tiles: bf16 rows, more than `min_rows` of them,
// K % 32 == 0, and AMX on for this process (amx_tiles / STREAMGATE_AMX).
inline bool amx_linear_rows(const torch::Tensor& x, int64_t min_rows) {
  return kLinearAmxBuilt && x.scalar_type() == torch::kBFloat16 && x.size(0) > min_rows && x.size(1) % 32 == 0 &&
         amx_switch().load(std::memory_order_relaxed);
}

}  // namespace streamgate::cpu
