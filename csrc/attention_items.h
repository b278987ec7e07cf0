// The paged attention kernel's entry checks and its work items (paged_attention.cpp): a
// batch's sequences cut into (sequence, KV head, query tile) items, or one item per decode row
// for all its heads, dealt into one bin per thread.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "attention_decode.h"
#include "attention_tiles.h"
#include "kv_int8.h"
#include "parallel.h"

namespace streamgate::cpu {

constexpr int64_t kQueryTile = 32;   // query rows of one sequence per work item
constexpr int64_t kQueryTileAmx = 32;   // ... on AMX tiles (attention_amx_item.h): 64 until 2026-12-05, when
                                        // 32 made a 286-token prompt's layer 0.35-0.37 ms against 0.40 (more
                                        // items to share between two threads) and a 512-token one level

struct Item {
  int64_t seq, kv_head, row_begin, row_end;   // rows counted from the sequence's first row
  int64_t h0 = 0, h1 = 0;                     // kv_head -1: a decode row (decode_sequence) for
                                              // KV heads [h0, h1) ...
  int64_t k0 = 0, k1 = 0;                     // ... and the row's keys [k0, k1) cut into `parts`
  int64_t parts = 1, p0 = 0, p1 = 1;          // (attention_parts.h), of which it runs [p0, p1);
  int64_t first_part = 0;                     // a part on its own: sums in slot first_part + p0
};

inline void check_inputs(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                         const torch::Tensor& block_tables, const torch::Tensor& q_start,
                         const torch::Tensor& ctx_lens, const torch::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3 && out.dim() == 3, "paged_attention: 3-d q/pool/out");
  TORCH_CHECK(q.stride(2) == 1 && k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && out.stride(2) == 1,
              "paged_attention: head_dim must be contiguous");
  TORCH_CHECK(k_pool.strides() == v_pool.strides() && k_pool.sizes() == v_pool.sizes(), "paged_attention: K and V pools differ");
  // An int8 pool (kv_int8.h) holds head_dim values and a 4-byte scale a row, for fp32/bf16/fp16 queries.
  const bool int8 = k_pool.scalar_type() == torch::kChar;
  TORCH_CHECK((int8 ? q.scalar_type() != torch::kDouble : q.scalar_type() == k_pool.scalar_type()) &&
              k_pool.scalar_type() == v_pool.scalar_type() && q.scalar_type() == out.scalar_type(),
              "paged_attention: one dtype (or an int8 pool for fp32/bf16/fp16 queries)");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0 && q.size(2) + (int8 ? kScaleBytes : 0) == k_pool.size(2),
              "paged_attention: head shapes");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous() && block_tables.dim() == 2,
              "paged_attention: block_tables int64 [B, W]");
  TORCH_CHECK(q_start.scalar_type() == torch::kLong && ctx_lens.scalar_type() == torch::kLong &&
              q_start.is_contiguous() && ctx_lens.is_contiguous(), "paged_attention: q_start/ctx_lens int64");
  const int64_t num_seqs = ctx_lens.size(0);
  TORCH_CHECK(q_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "paged_attention: batch sizes");
}

inline std::vector<std::vector<Item>> deal_items(const torch::Tensor& q, const torch::Tensor& k_pool,
                                                 const torch::Tensor& block_tables, const torch::Tensor& q_start,
                                                 const torch::Tensor& ctx_lens, int64_t block_size,
                                                 int64_t query_tile = kQueryTile, int64_t window = 0) {
  const int64_t num_seqs = ctx_lens.size(0);
  const int64_t* starts = q_start.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t num_kv_heads = k_pool.size(1), group = q.size(1) / num_kv_heads;
  // With AVX-512, a decode row of few query heads per KV head is one item for all its heads.
  const bool whole_decode = kDecode512 && group < kRows && q.size(2) % 16 == 0 && q.scalar_type() != at::kDouble;
  // A decode row of 256 keys or more is cut into parts (attention_parts.h). With fewer
  // sequences than threads (one decoded alone) its parts are items of their own; a row in one
  // part has its KV heads split over them instead, each head the same work as in the whole row
  // (the same bits). SmolLM2's one-row bf16 decode step on the Intel AMX host (three KV heads on
  // two threads): 15.2 -> 14.75 ms, builds alternating twice (2026-12-05); with the int8 KV cache
  // level.
  const int64_t pool = ElasticPool::get().threads();
  const int64_t runners = pool > 0 ? pool : at::get_num_threads();
  const bool split_heads = whole_decode && num_seqs < runners && num_kv_heads > 1;
  std::vector<Item> items;
  int64_t part_slots = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b] && starts[b + 1] <= q.size(0), "paged_attention: bad q_start/ctx_lens");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= block_tables.size(1), "paged_attention: block table too short");
    if (whole_decode && q_len == 1) {
      const int64_t begin = Features{window}.first_key(lens[b] - 1), end = lens[b];
      const int64_t parts = decode_parts(end - begin);
      if (parts > 1 && num_seqs < runners) {
        for (int64_t p = 0; p < parts; ++p) items.push_back({b, -1, 0, 1, 0, num_kv_heads, begin, end, parts, p, p + 1, part_slots});
        part_slots += parts;
      } else if (parts > 1 || !split_heads) {
        items.push_back({b, -1, 0, 1, 0, num_kv_heads, begin, end, parts, 0, parts});
      } else {
        for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({b, -1, 0, 1, h, h + 1, begin, end});
      }
      continue;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t r = 0; r < q_len; r += query_tile)
        items.push_back({b, h, r, std::min(q_len, r + query_tile)});
  }
  // at::parallel_for hands each thread one contiguous range, so items are first dealt into
  // one bin per thread, longest first, each to the least loaded bin (contexts are ragged); on
  // the elastic pool (parallel.h) two bins per thread, so a late helper's share is smaller.
  // With enough sequences to go round, a decode row's items (its KV heads) are dealt together and
  // run back to back: they read the same blocks (the heads of a slot are adjacent in memory),
  // which then come from cache rather than memory. A prefill chunk's query tiles are not: dealt
  // together they ran on one thread while the other took the decode rows (a 286-token chunk
  // beside 7 decode rows, Zen 4, 2 threads: 1.07 ms a layer, the chunk alone 0.54).
  const int64_t threads = pool > 0 ? 2 * pool : at::get_num_threads();
  const bool by_seq = num_seqs >= 2 * threads;
  std::vector<std::pair<int64_t, int64_t>> groups;                      // [first, last) items
  std::vector<int64_t> cost;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& w = items[i];
    const int64_t q_len = starts[w.seq + 1] - starts[w.seq];
    const int64_t heads = w.kv_head >= 0 ? 1 : w.h1 - w.h0;
    const int64_t c = w.kv_head >= 0 ? (w.row_end - w.row_begin) * (lens[w.seq] - q_len + w.row_end) * heads
                                     : (part_key(w.k0, w.k1, w.p1, w.parts, block_size) -
                                        part_key(w.k0, w.k1, w.p0, w.parts, block_size)) * heads;
    if (by_seq && q_len == 1 && !groups.empty() && items[groups.back().first].seq == w.seq) {
      groups.back().second = i + 1;
      cost.back() += c;
    } else {
      groups.emplace_back(i, i + 1);
      cost.push_back(c);
    }
  }
  std::vector<int64_t> order(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) order[g] = static_cast<int64_t>(g);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  const int64_t num_bins = std::max<int64_t>(1, std::min<int64_t>(threads, groups.size()));
  std::vector<std::vector<Item>> bins(num_bins);
  std::vector<int64_t> load(num_bins, 0);
  for (int64_t g : order) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    for (int64_t i = groups[g].first; i < groups[g].second; ++i) bins[b].push_back(items[i]);
    load[b] += cost[g];
  }
  return bins;
}

}  // namespace streamgate::cpu
