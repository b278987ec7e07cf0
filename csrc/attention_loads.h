// Bringing a decode row's next span of K/V into cache (for_decode_spans, attention_decode.h): one
// load a line where that beats prefetch instructions. AVX-512 builds only, as the decode rows.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "simd.h"

namespace streamgate::cpu {

#ifdef __AVX512F__
// How a decode row's span walk gets the next span's K/V into cache while it computes this one
// (blocks are scattered over the pool, and a span's compute loop keeps few misses in flight):
// - prefetch instructions (Intel's CPUs with AMX): the next span, a 1/kv_heads share before each
//   head (on the Intel AMX host a 32-row step's attention took 20 ms with them, 35 without:
//   HISTORY.md; the loads below were not measured there);
// - loads (elsewhere): one byte of every 64-byte line of the next span's K and V, its blocks side
//   by side, before this span's compute. On the Zen 4 host (2026-12-05) prefetcht0/t1/nta were
//   all level with none, while these loads (a tight loop, many misses in flight) halved decode
//   rows from memory: bench.engine.attention bf16, 2 threads, 32 x 340 tokens 24.3-25.5 -> 13.1 ms.
//   On the Intel Ice Lake host (no AMX; 2026-12-07) they beat the prefetches by 7-14 %: 32 x
//   287-350 tokens 24.5 / 20.7 -> 21.1 / 18.5 ms, 8 x 287-350 6.2 -> 5.6, 32 x 900-1,100 75.2 -> 69.8,
//   one sequence of 300 1.7 -> 1.5 (perf put ~94 % of the prefetching walk's own time on its
//   prefetcht0 and the next instruction: likely the line fill buffers full; not read from counters).
// torch.ops.streamgate.decode_span_loads switches; the outputs are bit-identical either way.
inline std::atomic<bool>& decode_span_loads() {
  static std::atomic<bool> on(!(intel_cpu() && cpu_has_amx()));
  return on;
}

// Loads one byte of each 64-byte line of positions [from, to) in the K and V pools (bytes [r0, r1)
// of each slot: all, or a range of KV heads), up to 16 blocks side by side (their misses in flight).
template <typename T>
inline void load_span(const T* kp, const T* vp, int64_t kv_slot, const int64_t* table, int64_t block_size,
                      int64_t from, int64_t to, int64_t r0, int64_t r1) {
  constexpr int kStreams = 16;
  const int64_t slot = kv_slot * static_cast<int64_t>(sizeof(T));
  const bool whole = r0 == 0 && r1 == slot;         // a block's rows are one contiguous range
  unsigned x = 0;
  while (from < to) {
    const char *ks[kStreams], *vs[kStreams];
    int64_t slots[kStreams], most = 0;
    int m = 0;
    for (; from < to && m < kStreams; ++m) {
      const int64_t in_block = std::min(block_size - from % block_size, to - from);
      const int64_t first = (table[from / block_size] * block_size + from % block_size) * kv_slot;
      ks[m] = reinterpret_cast<const char*>(kp + first), vs[m] = reinterpret_cast<const char*>(vp + first);
      slots[m] = in_block, most = std::max(most, in_block);
      from += in_block;
    }
    auto load = [&](int i, int64_t off) {
      x += *reinterpret_cast<const volatile unsigned char*>(ks[i] + off) +
           *reinterpret_cast<const volatile unsigned char*>(vs[i] + off);
    };
    if (whole) {
      for (int64_t off = 0; off < most * slot + 63; off += 64)
        for (int i = 0; i < m; ++i)
          if (off < slots[i] * slot + 63) load(i, std::min(off, slots[i] * slot - 1));
    } else {
      for (int64_t e = 0; e < most; ++e)
        for (int i = 0; i < m; ++i)
          if (e < slots[i])
            for (int64_t off = e * slot + r0; off < e * slot + r1 + 63; off += 64) load(i, std::min(off, e * slot + r1 - 1));
    }
  }
  asm volatile("" ::"r"(x));                        // the loads are the point, not their sum
}
#endif

}  // namespace streamgate::cpu
