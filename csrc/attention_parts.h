// A decode row's keys cut into parts (flash-decoding): each part an online softmax over its keys
// for all the row's heads, the parts' sums merged in part order into the row's output. A row
// decoded beside fewer sequences than threads runs its parts as work items of their own, and
// whichever thread finishes the last merges; a row among enough sequences runs them one after
// another in one item, each part's walk bringing the next part's first span into cache during
// its last (SpanChain), so it reads memory as a row in one part does.
//
// Why: a sequence decoded alone was split over the threads by KV head (SmolLM2's 3 heads: 2 : 1
// on two threads), each thread reading its heads' rows of every slot, a strided walk. In a step,
// the weights' stream has pushed the layer's K/V out of cache by the time attention reads it, so
// the walk waits on memory: SmolLM2 int8 (Zen 4 host, 2026-12-06, one row at ~300 tokens of
// context) spent 1.0-1.6 ms a step in attention and writing K/V. Parts give each thread whole
// slots, contiguous within a block, and an even share.
//
// The parts depend only on how many keys the row attends to, never on the batch, the threads or
// how the parts are run: a row gets the same bits alone, beside other sequences, or verified
// among its drafts (each draft attends as a decode row). Rows of fewer than 4 * kPartKeys (256)
// keys are one part, as before parts.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_tiles.h"
#include "simd.h"

namespace streamgate::cpu {

constexpr int64_t kPartKeys = 64;   // P parts take P * P * kPartKeys keys (decode_parts)
constexpr int64_t kMaxParts = 8;    // a power of two: parts share out evenly over 2, 4 or 8 threads

// Whether decode rows are cut into parts (torch.ops.streamgate.decode_parts; benchmarks compare).
// The outputs differ in rounding between the two.
inline std::atomic<bool>& decode_parts_switch() {
  static std::atomic<bool> on(true);
  return on;
}

// The parts of a decode row attending to `keys` keys: the largest power of two P up to kMaxParts
// with P * P * kPartKeys <= keys (2 parts from 256 keys, 4 from 1,024, 8 from 4,096). A part
// costs a row the same beside other sequences, where its parts run one after another (its sums
// stored and merged: 32 rows of 256 keys, Zen 4 host, 2026-12-06, attention alone 2 % slower in 2
// parts, 9 % in 4), so the parts grow slower than the keys.
inline int64_t decode_parts(int64_t keys) {
  if (!decode_parts_switch().load(std::memory_order_relaxed)) return 1;
  int64_t parts = 1;
  while (parts < kMaxParts && 4 * parts * parts * kPartKeys <= keys) parts *= 2;
  return parts;
}

// Keys per online-softmax step of the attention kernel (whole blocks, at least one). 128 since
// 2026-12-07 (64 before): a row's softmax bookkeeping per span (the max and sum across lanes, the
// rescale of its outputs) is paid half as often. Zen 4, SmolLM2's shapes, 30 layers, alternating
// builds: 32 decode rows over 320 tokens 9.2 against 10.1 ms, a 512-token chunk over 2,048 tokens
// 239 against 252 ms.
constexpr int64_t kSpanKeys = 128;
inline int64_t key_span(int64_t block_size) { return std::max<int64_t>(1, kSpanKeys / block_size) * block_size; }

// The first key of part p of keys [begin, end) cut into `parts` (p == parts: end): the nearest
// multiple of the span, so that no span is cut short (a row among others walks the same spans in
// parts as whole; cut at a multiple of the block instead, 8 rows of ~300 keys were 2 % slower).
inline int64_t part_key(int64_t begin, int64_t end, int64_t p, int64_t parts, int64_t block_size) {
  if (p <= 0) return begin;
  if (p >= parts) return end;
  const int64_t span = key_span(block_size);
  return std::clamp((begin + (end - begin) * p / parts + span / 2) / span * span, begin, end);
}

// The keys a decode_sequence call attends to: parts [p0, p1) of the row's keys [begin, end) cut
// into `parts`, and where the sums of a part go when the call is one part of a row run as items
// of their own (else: the row's output, merged from the scratch's sums when parts > 1).
struct DecodeKeys {
  int64_t begin, end;
  int64_t parts = 1, p0 = 0, p1 = 1;
  float* sums = nullptr;
};

// A row's parts walked one after another: the first span of this walk is already in cache
// (loaded), and [next0, next1) is the next part's first span, brought in during this walk's last.
struct SpanChain {
  bool loaded = false;
  int64_t next0 = 0, next1 = 0;
};

// A part's online softmax starts from the layer's sink in the row's first part only (the sink is
// one more score, counted once), elsewhere from nothing.
inline void start_part(const Features& f, bool first, float& m, float& l, int64_t head) {
  if (first) f.start(m, l, head);
  else m = -std::numeric_limits<float>::infinity(), l = 0.0f;
}

// A part's start for query heads [i0, i1) of a decode scratch `w` (its m, l and acc of D a head).
template <class Scratch>
inline void start_heads(const Features& f, bool first, Scratch& w, int64_t i0, int64_t i1, int64_t D) {
  for (int64_t i = i0; i < i1; ++i) start_part(f, first, w.m[i], w.l[i], i);
  std::fill(w.acc.begin() + i0 * D, w.acc.begin() + i1 * D, 0.0f);
}

// A part's floats per query head: the D unnormalized outputs (in the decode's accumulator order),
// the max, the sum.
inline int64_t part_floats(int64_t D) { return D + 2; }

// dst[d] = T(a[d] * inv) for d < D: an output row from its unnormalized sums and 1 / their weight.
template <typename T>
inline void store_scaled(T* dst, const float* a, float inv, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d] * inv);
}

// The row's output from its `parts` parts' sums (`heads` query heads each, part after part): per
// head the parts' outputs and sums rescaled to the largest max, added in part order, then
// store(dst, a, inv) writes head i's output dst = o + i * o_hs from the merged a (in the decode's
// accumulator order: the bf16 decode keeps its accumulators permuted) and 1 / the merged sum.
template <typename T, class Store>
inline void merge_decode_parts(const float* sums, int64_t parts, int64_t heads, int64_t D, T* o, int64_t o_hs, Store&& store) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t stride = heads * part_floats(D);
  thread_local std::vector<float> acc;
  at_least(acc, D);
  for (int64_t i = 0; i < heads; ++i) {
    vec8 m = vec8{} + kNegInf;
    for (int64_t p = 0; p < parts; ++p) m[p] = sums[p * stride + i * part_floats(D) + D];
    float top = kNegInf;
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, m[p]);
    const vec8 e = exp8_nonpositive(m - top);
    float weight[kMaxParts], total = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      weight[p] = m[p] == kNegInf ? 0.0f : e[p];            // a part that saw no score weighs nothing
      total += weight[p] * sums[p * stride + i * part_floats(D) + D + 1];
    }
    float* __restrict a = acc.data();
    const float* h = sums + i * part_floats(D);
    for (int64_t d = 0; d < D; ++d) a[d] = h[d] * weight[0];
    for (int64_t p = 1; p < parts; ++p) {
      const float* __restrict hp = h + p * stride;
      const float w = weight[p];
      for (int64_t d = 0; d < D; ++d) a[d] += hp[d] * w;
    }
    store(o + i * o_hs, static_cast<const float*>(a), 1.0f / total);
  }
}

// Runs a decode_sequence call's parts: start(first) sets up a part's softmax, walk(k0, k1, chain)
// walks its keys, finish(sums) stores it (sums null: the row's output, the row being one part).
// Returns where the parts' sums are when the caller must merge them into the output (the whole
// row in this call, in more than one part), else null.
template <class Start, class Walk, class Finish>
inline float* for_decode_parts(const DecodeKeys& keys, int64_t block_size, int64_t part_size, std::vector<float>& own,
                               Start&& start, Walk&& walk, Finish&& finish) {
  const int64_t span = key_span(block_size);
  auto key = [&](int64_t p) { return part_key(keys.begin, keys.end, p, keys.parts, block_size); };
  const bool whole_row = keys.p0 == 0 && keys.p1 == keys.parts;
  float* sums = keys.sums;
  if (!sums && keys.parts > 1) {
    if (static_cast<int64_t>(own.size()) < keys.parts * part_size) own.resize(keys.parts * part_size);
    sums = own.data();
  }
  for (int64_t p = keys.p0; p < keys.p1; ++p) {
    const int64_t k0 = key(p), k1 = key(p + 1);
    SpanChain chain{p > keys.p0, 0, 0};
    if (p + 1 < keys.p1) chain.next0 = k1, chain.next1 = std::min(key(p + 2), k1 + span);
    start(p == 0);
    walk(k0, k1, chain);
    finish(keys.parts > 1 ? sums + (p - keys.p0) * part_size : nullptr);
  }
  return whole_row && keys.parts > 1 ? sums : nullptr;
}

}  // namespace streamgate::cpu
