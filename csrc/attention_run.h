// The paged attention kernel's body (paged_attention.cpp's operators call it): one pass over a
// batch's work items (attention_items.h), dealt to the threads. Queries and outputs are
// scalar_t; the pools are scalar_t too, or int8 rows of head_dim values and a scale
// (kv_int8.h), which decode rows read in place (decode_sequence scales scores and
// probabilities), and query tiles dequantize span by span into the buffers they already fill
// (fp32 tiles), or into bf16 rows first (the VDPBF16PS and AMX tiles).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_amx_item.h"
#include "attention_bf16.h"
#include "attention_decode.h"
#include "attention_decode_bf16.h"
#include "attention_tile_bf16.h"
#include "attention_items.h"
#include "attention_pack.h"
#include "attention_tiles.h"
#include "kv_int8.h"
#include "parallel.h"
#include "simd.h"

namespace streamgate::cpu {

// One thread's buffers for run_attention, kept across calls and grown, never shrunk: allocated
// and zero-filled per call they took as long as a one-row step's attention math (Zen 4 host,
// 2026-12-06: the vectors' constructors, memset and malloc/free against its scores and values).
template <typename scalar_t, typename pool_t>
struct AttentionScratch {
  std::vector<float> qf, acc, m, l, alpha, s, kT, vb;
  std::vector<int64_t> qpos;
  std::vector<const float*> krow, vrow;
  DecodeScratch<pool_t> decode;
  DecodeScratchBf16 decode16;
  std::vector<c10::BFloat16> qb, pb;
  std::vector<uint32_t> kP, vP;
  std::vector<const scalar_t*> vsrc;
  std::vector<scalar_t> kq, vq;
};

template <typename scalar_t, typename pool_t>
AttentionScratch<scalar_t, pool_t>& attention_scratch() {
  thread_local AttentionScratch<scalar_t, pool_t> scratch;
  return scratch;
}

template <typename scalar_t, typename pool_t = scalar_t>
void run_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                   const torch::Tensor& block_tables, const torch::Tensor& q_start, const torch::Tensor& ctx_lens,
                   int64_t block_size, double scale, const Features& f, torch::Tensor& out,
                   const std::vector<std::vector<Item>>& bins, bool use_amx) {
  constexpr bool int8 = std::is_same_v<pool_t, int8_t>;
  const int64_t num_heads = q.size(1), D = q.size(2);
  const int64_t num_kv_heads = k_pool.size(1), group = num_heads / num_kv_heads;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const pool_t* kp = k_pool.data_ptr<pool_t>();
  const pool_t* vp = v_pool.data_ptr<pool_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t kv_slot = k_pool.stride(0), kv_head_stride = k_pool.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_width = block_tables.size(1);
  const int64_t* starts = q_start.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // Keys are taken `span` at a time (whole blocks) so that the softmax bookkeeping per query
  // row is paid once per span, not once per (small) block.
  const int64_t span = key_span(block_size);
  const int64_t kpad = (span + kLanes - 1) / kLanes * kLanes;             // keys per span, padded
  const int64_t tile_rows = use_amx ? kQueryTileAmx : kQueryTile;      // query rows per item (deal_items)
  // bf16 pools with bf16 dot products: query tiles take the VDPBF16PS tiles (attention_bf16.h).
  constexpr bool bf16_tiles = kTileBf16 && std::is_same_v<scalar_t, c10::BFloat16>;
  const bool tile16 = bf16_tiles && D % 16 == 0;
  const int64_t kpad16 = (kpad + 15) / 16 * 16;
  const bool decode16 = kDecodeBf16 && std::is_same_v<scalar_t, c10::BFloat16> && !int8 && D % 32 == 0;
  const bool amx = bf16_tiles && use_amx;                                 // ... or on AMX (attention_amx_item.h)
  // Query vectors per item in the buffers below (AMX items use their own, made on the first).
  const int64_t max_q = (amx ? kQueryTile : tile_rows) * group;

  // Decode rows cut into parts (attention_parts.h): each part's sums, and per row how many of its
  // parts are done (the thread that finishes the last merges). The calling thread's, reused.
  int64_t part_slots = 0;
  for (const auto& bin : bins)
    for (const Item& w : bin)
      if (w.p1 - w.p0 < w.parts) part_slots = std::max(part_slots, w.first_part + w.parts);
  thread_local std::vector<float> part_sums;
  thread_local std::vector<int> parts_done;
  const int64_t part_size = num_heads * part_floats(D);
  at_least(part_sums, part_slots * part_size);
  parts_done.assign(part_slots, 0);
  float* const part_base = part_sums.data();      // by pointer: in a helper, the names are its own
  int* const done_base = parts_done.data();
  // The spans of sequences with several query tiles, packed once for all of them (attention_pack.h).
  thread_local SharedSpans shared_spans;
  shared_spans.first.clear();
  if constexpr (bf16_tiles) {
    if (tile16 && !amx && f.window == 0)
      pack_shared_spans<scalar_t, pool_t>(shared_spans, bins, kp, vp, kv_slot, kv_head_stride,
                                          tables, table_width, lens, ctx_lens.size(0), num_kv_heads, group, block_size,
                                          span, kpad16, D);
  }
  const SharedSpans& shared = shared_spans;

  streamgate::cpu::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t first_bin, int64_t last_bin) {
    // qf [max_q, D] scaled queries; kT [D, kpad] one span of K transposed; vb [kpad, D] its V;
    // s [max_q, kpad] scores, then probabilities; acc [max_q, D] unnormalized outputs; m, l, alpha
    // the online softmax's running max, running sum and this span's rescale, per query vector.
    // This thread's, reused across calls (attention_scratch); past what a span writes they hold
    // an earlier span's values, which no score or value reads (the softmax masks them out).
    auto& b = attention_scratch<scalar_t, pool_t>();
    auto &qf = b.qf, &acc = b.acc, &m = b.m, &l = b.l, &alpha = b.alpha, &s = b.s, &kT = b.kT, &vb = b.vb;
    auto &qpos = b.qpos, &krow = b.krow, &vrow = b.vrow;
    at_least(qf, max_q * D), at_least(acc, max_q * D), at_least(s, max_q * kpad), at_least(qpos, max_q);
    at_least(m, max_q), at_least(l, max_q), at_least(alpha, max_q);
    at_least(kT, D * kpad), at_least(vb, kpad * D), at_least(krow, kpad), at_least(vrow, kpad);
    // krow/vrow: where key/value t of the span is read (in the pool, or converted in kT/vb).
    for (int64_t t = 0; t < kpad; ++t) krow[t] = kT.data() + t * D, vrow[t] = vb.data() + t * D;
    auto &scratch = b.decode, &scratch16 = b.decode16;
    if (kDecode512 && !decode16) scratch.fit(num_heads, D, kpad);
    if (decode16) scratch16.fit(num_heads, D, kpad);
    // The bf16 tiles' buffers: qb the tile's queries, kP/vP the span's keys/values packed in
    // pairs, pb the probabilities in bf16, vsrc where value t of the span is read; kq/vq an int8
    // pool's span for the bf16 tiles, its keys and values dequantized to bf16 rows.
    auto &qb = b.qb, &pb = b.pb, &vsrc = b.vsrc, &kq = b.kq, &vq = b.vq;
    auto &kP = b.kP, &vP = b.vP;
    at_least(vsrc, kpad);
    if (tile16) at_least(qb, max_q * D), at_least(pb, max_q * kpad16), at_least(kP, D / 2 * kpad16), at_least(vP, kpad16 / 2 * D);
    if (int8 && tile16) at_least(kq, kpad * D), at_least(vq, kpad * D);
    // A thread's tile configuration and zeroed buffers: made on its first AMX item, if one comes.
    std::optional<AmxScope> amx_scope;
    std::optional<AmxScratch> amx_scratch;
    for (int64_t bin = first_bin; bin < last_bin; ++bin)
    for (const Item& w : bins[bin]) {
      if (w.kv_head < 0) {
        const int64_t row = starts[w.seq];
        // One part of a row whose parts are items of their own: its sums to the call's buffer.
        float* sums = w.p1 - w.p0 < w.parts ? part_base + (w.first_part + w.p0) * part_size : nullptr;
        const DecodeKeys keys{w.k0, w.k1, w.parts, w.p0, w.p1, sums};
        bool done = false;
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && !int8) {
          if (decode16) {
            decode_sequence_bf16(qp + row * q_row, q_head, kp, vp, kv_slot, kv_head_stride, tables + w.seq * table_width,
                                 block_size, keys, span, kpad, num_kv_heads, w.h0, w.h1, group, D, fscale, op + row * o_row,
                                 o_head, scratch16, f);
            done = true;
          }
        }
        if (!done)
          decode_sequence(qp + row * q_row, q_head, kp, vp, kv_slot, kv_head_stride, tables + w.seq * table_width,
                          block_size, keys, span, kpad, num_kv_heads, w.h0, w.h1, group, D, fscale, op + row * o_row,
                          o_head, scratch, f);
        // The row's last part to finish merges them all (acq_rel: it sees every part's sums).
        if (sums && std::atomic_ref<int>(done_base[w.first_part]).fetch_add(1, std::memory_order_acq_rel) == w.parts - 1)
          merge_decode_parts(part_base + w.first_part * part_size, w.parts, num_heads, D, op + row * o_row, o_head,
                             [bf16 = done, D](scalar_t* dst, const float* a, float inv) {
                               if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
                                 if (bf16) return store_unpermuted_bf16(dst, a, inv, D);
                               }
                               store_scaled(dst, a, inv, D);
                             });
        continue;
      }
      const int64_t q_len = starts[w.seq + 1] - starts[w.seq];
      const int64_t ctx = lens[w.seq];
      const int64_t nq = (w.row_end - w.row_begin) * group;
      const bool by_key = nq < kRows;                                  // a decode row: few query vectors
      if constexpr (bf16_tiles) {
        if (amx && !by_key) {
          AmxItem item{qp + starts[w.seq] * q_row + w.kv_head * group * q_head, q_row, q_head, nullptr, nullptr,
                       kv_slot, tables + w.seq * table_width, block_size, ctx, q_len, w.row_begin, w.row_end, group,
                       D, span, fscale, w.kv_head * group, op + starts[w.seq] * o_row + w.kv_head * group * o_head,
                       o_row, o_head};
          if constexpr (int8) item.k8 = kp + w.kv_head * kv_head_stride, item.v8 = vp + w.kv_head * kv_head_stride;
          else item.k = kp + w.kv_head * kv_head_stride, item.v = vp + w.kv_head * kv_head_stride;
          if (!amx_scratch) amx_scope.emplace(true), amx_scratch.emplace(tile_rows * group, D, span);
          tile_item_amx(item, f, *amx_scratch);
          continue;
        }
      }
      const bool packed = tile16 && !by_key;                           // a query tile on bf16 dot products
      // Query vectors of the tile, scaled, fp32: index i = row * group + g.
      for (int64_t r = w.row_begin; r < w.row_end; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t i = (r - w.row_begin) * group + g;
          const scalar_t* src = qp + (starts[w.seq] + r) * q_row + (w.kv_head * group + g) * q_head;
          qpos[i] = ctx - q_len + r;
          if (packed) {
            std::memcpy(qb.data() + i * D, src, D * sizeof(scalar_t));
            continue;
          }
          float* dst = qf.data() + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
        }
      }
      std::fill(acc.begin(), acc.begin() + nq * D, 0.0f);
      for (int64_t i = 0; i < nq; ++i) f.start(m[i], l[i], w.kv_head * group + i % group);
      const int64_t last_pos = ctx - q_len + w.row_end - 1;            // the tile's last query
      const int64_t* table = tables + w.seq * table_width;
      // A sliding layer starts at the tile's first query's window (not block aligned).
      for (int64_t b0 = f.first_key(ctx - q_len + w.row_begin); b0 <= last_pos; b0 += span) {
        const int64_t n = std::min(span, last_pos + 1 - b0);           // keys used in this span
        const uint32_t* spanK = packed ? shared.keys(w.seq, w.kv_head, b0 / span) : nullptr;   // packed once
        if (spanK) {
          if constexpr (bf16_tiles)
            tile_span_bf16(TileBf16{qb.data(), spanK, shared.values(spanK, D, kpad16), s.data(), pb.data(),
                                    acc.data(), m.data(), l.data(), alpha.data(), qpos.data(), nq, kpad, kpad16, D,
                                    fscale}, b0, n, f);
          continue;
        }
        // Keys and values of the span, block by block (one table lookup per block). A decode
        // row reads fp32 rows in place and converts other dtypes into kT/vb row by row; a
        // query tile gets K transposed into kT for the outer-product scores.
        for (int64_t t = 0; t < n;) {
          const int64_t pos = b0 + t, in_block = std::min(block_size - pos % block_size, n - t);
          const int64_t first = table[pos / block_size] * block_size + pos % block_size;
          if constexpr (bf16_tiles) {                                  // attention_tile_bf16.h
            if (packed) {
              const int64_t off = first * kv_slot + w.kv_head * kv_head_stride;
              pack_block_bf16(kp + off, vp + off, kv_slot, t, in_block, kP.data(), kpad16, D, kq.data(), vq.data(),
                              vsrc.data());
              t += in_block;
              continue;
            }
          }
          for (int64_t e = 0; e < in_block; ++e, ++t) {
            const int64_t off = (first + e) * kv_slot + w.kv_head * kv_head_stride;
            if (by_key && std::is_same_v<pool_t, float>) {
              krow[t] = reinterpret_cast<const float*>(kp + off);
              vrow[t] = reinterpret_cast<const float*>(vp + off);
              continue;
            }
            // An int8 row's scale (kv_int8.h); 1 for other pools, whose values it leaves exact.
            const float ks = int8 ? row_scale(reinterpret_cast<const int8_t*>(kp + off), D) : 1.0f;
            const float vs = int8 ? row_scale(reinterpret_cast<const int8_t*>(vp + off), D) : 1.0f;
            if (by_key) {
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) kT[t * D + d] = static_cast<float>(kp[off + d]) * ks;
            } else {
              for (int64_t d = 0; d < D; ++d) kT[d * kpad + t] = static_cast<float>(kp[off + d]) * ks;
            }
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) vb[t * D + d] = static_cast<float>(vp[off + d]) * vs;
          }
        }
        if (packed) {                                                  // attention_tile_bf16.h
          if constexpr (bf16_tiles)
            for (int64_t t = 0; t < n; t += 2)
              pack_values_bf16(vsrc[t], t + 1 < n ? vsrc[t + 1] : nullptr, vP.data() + t / 2 * D, D);
          tile_span_bf16(TileBf16{qb.data(), kP.data(), vP.data(), s.data(), pb.data(), acc.data(), m.data(), l.data(),
                                  alpha.data(), qpos.data(), nq, kpad, kpad16, D, fscale}, b0, n, f);
          continue;
        }
        for_row_groups(nq, [&]<int R>(int64_t i) {                     // keys >= n: never read
          if (by_key) scores_rows_by_key<R>(qf.data() + i * D, krow.data(), s.data() + i * kpad, kpad, n, D);
          else scores_rows<R>(qf.data() + i * D, kT.data(), s.data() + i * kpad, kpad, D);
        });
        // Online softmax per query row: s becomes the span's probabilities (0 before the row's
        // window and past its causal cut), alpha the rescale of what was accumulated.
        softmax_rows(s.data(), kpad, nq, qpos.data(), b0, n, f, m.data(), l.data(), alpha.data(),
                     [&](int64_t i) { return ProbsF32{s.data() + i * kpad}; });
        for_row_groups(nq, [&]<int R>(int64_t i) {
          if (by_key) values_rows_by_key<R>(s.data() + i * kpad, alpha.data() + i, vrow.data(), acc.data() + i * D, kpad, n, D);
          else values_rows<R>(s.data() + i * kpad, alpha.data() + i, vb.data(), acc.data() + i * D, kpad, n, D);
        });
      }
      for (int64_t r = w.row_begin; r < w.row_end; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t i = (r - w.row_begin) * group + g;
          const float inv = 1.0f / l[i];
          scalar_t* dst = op + (starts[w.seq] + r) * o_row + (w.kv_head * group + g) * o_head;
          const float* ai = acc.data() + i * D;
          if constexpr (bf16_tiles) {
            if (D % 16 == 0) {
              store_scaled_bf16(dst, ai, inv, D);
              continue;
            }
          }
          store_scaled(dst, ai, inv, D);
        }
      }
    }
  });
}


}  // namespace streamgate::cpu
