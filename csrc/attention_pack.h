// A call's key and value spans packed once for the VDPBF16PS tiles (attention_tile_bf16.h) of
// every sequence that has more than one query tile, instead of once per tile.
//
// Why: tile i of a chunk attends to spans 0..i, so each tile packed again what the tiles before
// it packed (keys transposed in pairs, values interleaved in pairs): a 512-token first chunk
// packs each span eight times on average, a 512-token chunk over 2,048 tokens each of its 20
// spans sixteen times. Here a first parallel pass packs each (sequence, KV head, span) once into
// a buffer the tiles then read. Packing is a layout, not arithmetic; a tile reads the keys and
// values it used before (a span packed whole holds keys past a tile's causal cut, which get
// probability 0 and are finite, so the sums do not change): the same bits.
//
// Only where the spans are the same for every tile: layers without a sliding window (a window's
// spans start at each tile's first visible key) and tiles not on AMX (attention_amx_item.h); and
// up to kSharedSpanBytes a call (the buffer is kept and reused, never shrunk): past it, the
// other sequences' tiles pack their own spans as before.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_items.h"
#include "attention_tile_bf16.h"
#include "parallel.h"

namespace streamgate::cpu {

constexpr int64_t kSharedSpanBytes = int64_t{64} << 20;

struct SharedSpans {
  // per (sequence, KV head, span): its keys kP [D/2][kpad16], then its values vP [kpad16/2][D]
  std::vector<uint32_t> words;
  std::vector<int64_t> first;          // per (sequence, KV head): its first span's index in `words`, -1 if not packed
  int64_t span_words = 0, kv_heads = 0;

  // Span s of (seq, head), packed: its keys (null if that sequence's spans are not shared).
  const uint32_t* keys(int64_t seq, int64_t head, int64_t s) const {
    const int64_t f = first.empty() ? -1 : first[seq * kv_heads + head];
    return f < 0 ? nullptr : words.data() + (f + s) * span_words;
  }
  const uint32_t* values(const uint32_t* keys, int64_t D, int64_t kpad16) const { return keys + D / 2 * kpad16; }
};

// Packs the shared spans of a call (none unless bf16 tiles run on VDPBF16PS and the layer has
// no window) into `out`: a sequence shares its spans if it has more than one query tile.
template <typename scalar_t, typename pool_t>
void pack_shared_spans(SharedSpans& out, const std::vector<std::vector<Item>>& bins, const pool_t* kp,
                       const pool_t* vp, int64_t kv_slot, int64_t kv_head_stride, const int64_t* tables,
                       int64_t table_width, const int64_t* lens, int64_t num_seqs,
                       int64_t kv_heads, int64_t group, int64_t block_size, int64_t span, int64_t kpad16, int64_t D) {
  out.first.assign(num_seqs * kv_heads, -1);
  out.kv_heads = kv_heads;
  out.span_words = D / 2 * kpad16 + kpad16 / 2 * D;
  std::vector<int64_t> tiles(num_seqs * kv_heads, 0);
  for (const auto& bin : bins)
    for (const Item& w : bin)
      if (w.kv_head >= 0 && (w.row_end - w.row_begin) * group >= kRows) ++tiles[w.seq * kv_heads + w.kv_head];
  std::vector<std::pair<int64_t, int64_t>> units;           // (sequence * kv_heads + head, span)
  int64_t spans = 0;
  for (int64_t i = 0; i < num_seqs * kv_heads; ++i) {
    const int64_t n = (lens[i / kv_heads] + span - 1) / span;
    if (tiles[i] < 2 || (spans + n) * out.span_words * int64_t{sizeof(uint32_t)} > kSharedSpanBytes) continue;
    out.first[i] = spans;
    for (int64_t s = 0; s < n; ++s) units.emplace_back(i, s);
    spans += n;
  }
  if (spans == 0) return;
  if (static_cast<int64_t>(out.words.size()) < spans * out.span_words) out.words.resize(spans * out.span_words);
  streamgate::cpu::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t u0, int64_t u1) {
    thread_local std::vector<const scalar_t*> vsrc;
    thread_local std::vector<scalar_t> kq, vq;
    if (static_cast<int64_t>(vsrc.size()) < span) vsrc.resize(span);
    if (std::is_same_v<pool_t, int8_t> && static_cast<int64_t>(kq.size()) < span * D)
      kq.resize(span * D), vq.resize(span * D);
    for (int64_t u = u0; u < u1; ++u) {
      const auto [i, s] = units[u];
      const int64_t seq = i / kv_heads, head = i % kv_heads, b0 = s * span, n = std::min(span, lens[seq] - b0);
      uint32_t* kP = out.words.data() + (out.first[i] + s) * out.span_words;
      uint32_t* vP = kP + D / 2 * kpad16;
      const int64_t* table = tables + seq * table_width;
      for (int64_t t = 0; t < n;) {
        const int64_t pos = b0 + t, in_block = std::min(block_size - pos % block_size, n - t);
        const int64_t off = (table[pos / block_size] * block_size + pos % block_size) * kv_slot + head * kv_head_stride;
        pack_block_bf16(kp + off, vp + off, kv_slot, t, in_block, kP, kpad16, D, kq.data(), vq.data(), vsrc.data());
        t += in_block;
      }
      for (int64_t t = 0; t < n; t += 2)
        pack_values_bf16(vsrc[t], t + 1 < n ? vsrc[t + 1] : nullptr, vP + t / 2 * D, D);
    }
  });
}

}  // namespace streamgate::cpu
