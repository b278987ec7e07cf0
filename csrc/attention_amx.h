// AMX primitives for the prefill tiles of a bf16 pool (attention_amx_item.h): whether this
// process may run AMX tiles, the tile configuration, a 16 x 16 transpose of 32-bit words, and
// the two products of a query tile as TDPBF16PS on 16 x 16 tiles: scores transposed, Sᵀ = K Qᵀ
// (keys as A, rows straight from a contiguous copy; the queries as B, packed once per item in
// AMX's pair layout), and outputs += P V (probabilities as A, the values as B in key pairs,
// vP[t/2][d], as attention_bf16.h packs them). Products of two bf16 are exact in fp32 and
// accumulate in fp32; only the order of the sums differs from the VDPBF16PS tiles.
//
// Compiled into the avx512_bf16 variant with the AMX target on these functions only, and run
// where the CPU has AMX-BF16 and Linux grants the tile state (arch_prctl), unless
// STREAMGATE_AMX=0 or `torch.ops.streamgate.amx_tiles(False)` turns it off.
#pragma once

#include <c10/util/BFloat16.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "simd.h"

#if defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace streamgate::cpu {

constexpr bool kAmxBuilt = true;

// Whether this process may run AMX tiles: the CPU has AMX-TILE and AMX-BF16 (simd.h's
// cpu_has_amx) and the kernel grants this process the tile data state (Linux >= 5.16).
inline bool amx_supported() {
  static const bool ok = [] {
    if (!cpu_has_amx()) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("STREAMGATE_AMX");
    return amx_supported() && !(env && env[0] == '0');
  }()};
  return on;
}

// Tile registers 0-3 accumulate (C), 4 holds A and 5 holds B (linear_amx.h also uses 6
// for a second B and 7 for a second A); every tile is 16 rows of 64 bytes (16 fp32, or 32
// bf16 = 16 pairs).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline const TileConfig& tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
    return c;
  }();
  return cfg;
}

// A thread's tile configuration for the kernels below; released (tiles back to their initial
// state, as oneDNN expects to find them) when the thread's share of the call ends.
class AmxScope {
 public:
  __attribute__((target("amx-tile"))) explicit AmxScope(bool on) : on_(on) {
    if (on_) _tile_loadconfig(&tile_config());
  }
  __attribute__((target("amx-tile"))) ~AmxScope() {
    if (on_) _tile_release();
  }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;

 private:
  bool on_;
};

// GCC's tile loads are asm without a memory operand: this keeps the stores that filled a
// buffer ahead of the load that reads it.
#define SG_AMX_FENCE() asm volatile("" ::: "memory")

// sT[t][i] = k_t . q_i for keys t < keys64 (a multiple of 64; kb [keys64][D] bf16 rows) and
// query vectors i < rows16 (a multiple of 16; qT [D/2][rows16] words: (q_i[2p], q_i[2p+1])),
// sT [keys64][rows16] fp32. D % 32 == 0.
__attribute__((target("amx-tile,amx-bf16"))) inline void scores_t_amx(const c10::BFloat16* kb, int64_t keys64,
                                                                      const uint32_t* qT, int64_t rows16, float* sT,
                                                                      int64_t D) {
  SG_AMX_FENCE();
  const long kbytes = D * 2, qbytes = rows16 * 4;
  for (int64_t t0 = 0; t0 < keys64; t0 += 64) {
    const c10::BFloat16* a = kb + t0 * D;
    for (int64_t g = 0; g < rows16; g += 16) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
        _tile_loadd(5, qT + p0 * rows16 + g, qbytes);
        _tile_loadd(4, a + 2 * p0, kbytes);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(4, a + 16 * D + 2 * p0, kbytes);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(4, a + 32 * D + 2 * p0, kbytes);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(4, a + 48 * D + 2 * p0, kbytes);
        _tile_dpbf16ps(3, 4, 5);
      }
      float* c = sT + t0 * rows16 + g;
      _tile_stored(0, c, qbytes);
      _tile_stored(1, c + 16 * rows16, qbytes);
      _tile_stored(2, c + 32 * rows16, qbytes);
      _tile_stored(3, c + 48 * rows16, qbytes);
    }
  }
}

// C (2 or 4) column tiles of 16 outputs at c (rows of D fp32) += 16 rows of probabilities a
// (abytes apart) times the values vP's columns from d0, over keys t < keys32.
template <int C>
__attribute__((target("amx-tile,amx-bf16"))) inline void values_tiles(const c10::BFloat16* a, long abytes,
                                                                      const uint32_t* vP, int64_t keys32, float* c,
                                                                      int64_t D, int64_t d0) {
  static_assert(C == 2 || C == 4, "two or four column tiles");
  const long bytes = D * 4;                        // a row of vP (words) and of acc (fp32)
  _tile_loadd(0, c, bytes);
  _tile_loadd(1, c + 16, bytes);
  if constexpr (C == 4) {
    _tile_loadd(2, c + 32, bytes);
    _tile_loadd(3, c + 48, bytes);
  }
  for (int64_t k0 = 0; k0 < keys32; k0 += 32) {
    const uint32_t* b = vP + k0 / 2 * D + d0;
    _tile_loadd(4, a + k0, abytes);
    _tile_loadd(5, b, bytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, b + 16, bytes);
    _tile_dpbf16ps(1, 4, 5);
    if constexpr (C == 4) {
      _tile_loadd(5, b + 32, bytes);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, b + 48, bytes);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, bytes);
  _tile_stored(1, c + 16, bytes);
  if constexpr (C == 4) {
    _tile_stored(2, c + 32, bytes);
    _tile_stored(3, c + 48, bytes);
  }
}

// acc[i] += sum_t p_i[t] v_t for rows i < rows16 over keys t < keys32 (a multiple of 32: pb
// [rows16][pstride] bf16, zeros from each row's last key to keys32; vP [keys32/2][D] words,
// finite). D % 32 == 0: four column tiles at a time, two for the last 32 where D % 64 == 32.
__attribute__((target("amx-tile,amx-bf16"))) inline void values_amx(const c10::BFloat16* pb, int64_t pstride,
                                                                    int64_t rows16, const uint32_t* vP,
                                                                    int64_t keys32, float* acc, int64_t D) {
  SG_AMX_FENCE();
  for (int64_t r0 = 0; r0 < rows16; r0 += 16) {
    const c10::BFloat16* a = pb + r0 * pstride;
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) values_tiles<4>(a, pstride * 2, vP, keys32, acc + r0 * D + d0, D, d0);
    if (d0 < D) values_tiles<2>(a, pstride * 2, vP, keys32, acc + r0 * D + d0, D, d0);
  }
}

// r[j] becomes column j of the 16 x 16 matrix of 32-bit words whose rows r held.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Columns [0, n) of out [D/2][stride] words from vectors x[0..n) (n <= 16; D bf16 each, D % 32
// == 0): out[p][i] = (x_i[2p], x_i[2p+1]), AMX's pair layout of a B operand; columns n..15 zero.
inline void pack_pairs16(const c10::BFloat16* const* x, int64_t n, uint32_t* out, int64_t stride, int64_t D) {
  for (int64_t c = 0; c < D / 2; c += 16) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < n ? _mm512_loadu_si512(x[i] + 2 * c) : _mm512_setzero_si512();
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (c + i) * stride, r[i]);
  }
}

#undef SG_AMX_FENCE

}  // namespace streamgate::cpu

#else

namespace streamgate::cpu {

constexpr bool kAmxBuilt = false;

inline bool amx_supported() { return false; }
inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{false};
  return on;
}
class AmxScope {
 public:
  explicit AmxScope(bool) {}
};
inline void scores_t_amx(const c10::BFloat16*, int64_t, const uint32_t*, int64_t, float*, int64_t) {}
inline void values_amx(const c10::BFloat16*, int64_t, int64_t, const uint32_t*, int64_t, float*, int64_t) {}
inline void pack_pairs16(const c10::BFloat16* const*, int64_t, uint32_t*, int64_t, int64_t) {}

}  // namespace streamgate::cpu

#endif
