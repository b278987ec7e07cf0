// Paged attention on the CPU: each query row reads its sequence's keys and values in place,
// block by block through the block table, with an online softmax (no copy of the context).
//
// One call covers a whole packed batch: decode rows (one query each) and prefill chunks (many
// queries over cached context plus themselves). Sequence b owns the packed query rows
// [q_start[b], q_start[b+1]); its context is ctx_lens[b] tokens long and already holds the
// step's new keys/values, so query row j of b sits at position ctx_lens[b] - q_len + j and
// attends causally to positions 0..that. Work is split over (sequence, kv head, query tile)
// so the query heads of a GQA group share each K/V load. Math is fp32 whatever the storage
// dtype (fp32, bf16, fp16).
//
// Per work item the keys come a span (64 positions, whole blocks) at a time, converted to fp32
// into a small buffer; the tile's query vectors times the span are small GEMMs done as
// register-tiled outer products (scores_rows, values_rows: 1-4 query vectors per step, GCC/Clang
// vector extensions, so AVX2 on x86 and NEON elsewhere), with an online softmax across spans
// and the causal cut applied per query row. A decode row has too few query vectors to pay for
// transposing the keys, so it takes dot products against keys stored row by row instead; with
// AVX-512 a decode row is one work item for all its KV heads, reading keys and values in place
// in any dtype (decode_sequence, attention_decode.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_bf16.h"
#include "attention_decode.h"
#include "attention_decode_bf16.h"
#include "attention_tiles.h"
#include "simd.h"

namespace {

using namespace streamgate::cpu;

constexpr int64_t kQueryTile = 32;   // query rows of one sequence per work item
constexpr int64_t kSpan = 64;        // keys per online-softmax step (whole blocks, at least one)

struct Item {
  int64_t seq, kv_head, row_begin, row_end;   // rows counted from the sequence's first row
};                                            // kv_head -1: a decode row, all heads (decode_sequence)

template <typename scalar_t>
void run(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
         const torch::Tensor& block_tables, const torch::Tensor& q_start, const torch::Tensor& ctx_lens,
         int64_t block_size, double scale, torch::Tensor& out, const std::vector<std::vector<Item>>& bins) {
  const int64_t num_heads = q.size(1), D = q.size(2);
  const int64_t num_kv_heads = k_pool.size(1), group = num_heads / num_kv_heads;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_pool.data_ptr<scalar_t>();
  const scalar_t* vp = v_pool.data_ptr<scalar_t>();
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
  const int64_t span = std::max<int64_t>(1, kSpan / block_size) * block_size;
  const int64_t kpad = (span + kLanes - 1) / kLanes * kLanes;             // keys per span, padded
  const int64_t max_q = kQueryTile * group;                               // query vectors per item
  // bf16 pools with bf16 dot products: query tiles take the VDPBF16PS tiles (attention_bf16.h).
  constexpr bool bf16_tiles = kTileBf16 && std::is_same_v<scalar_t, c10::BFloat16>;
  const bool tile16 = bf16_tiles && D % 16 == 0;
  const int64_t kpad16 = (kpad + 15) / 16 * 16;
  const bool decode16 = kDecodeBf16 && std::is_same_v<scalar_t, c10::BFloat16> && D % 32 == 0;

  at::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t first_bin, int64_t last_bin) {
    // qf [max_q, D] scaled queries; kT [D, kpad] one span of K transposed; vb [kpad, D] its V;
    // s [max_q, kpad] scores, then probabilities; acc [max_q, D] unnormalized outputs; m, l, alpha
    // the online softmax's running max, running sum and this span's rescale, per query vector.
    std::vector<float> qf(max_q * D), acc(max_q * D), m(max_q), l(max_q), alpha(max_q), s(max_q * kpad);
    std::vector<float> kT(D * kpad, 0.0f), vb(kpad * D);                  // kT holds kb [kpad, D] by key
    std::vector<int64_t> qpos(max_q);
    // krow/vrow: where key/value t of the span is read (in the pool, or converted in kT/vb).
    std::vector<const float*> krow(kpad), vrow(kpad);
    for (int64_t t = 0; t < kpad; ++t) krow[t] = kT.data() + t * D, vrow[t] = vb.data() + t * D;
    DecodeScratch<scalar_t> scratch(kDecode512 && !decode16 ? num_heads : 0, D, kpad);
    DecodeScratchBf16 scratch16(decode16 ? num_heads : 0, D, kpad);
    // The bf16 tiles' buffers: qb the tile's queries, kP/vP the span's keys/values packed in
    // pairs, pb the probabilities in bf16, vsrc where value t of the span is read.
    std::vector<c10::BFloat16> qb(tile16 ? max_q * D : 0), pb(tile16 ? max_q * kpad16 : 0);
    std::vector<uint32_t> kP(tile16 ? D / 2 * kpad16 : 0, 0u), vP(tile16 ? kpad16 / 2 * D : 0);
    std::vector<const scalar_t*> vsrc(kpad);
    for (int64_t bin = first_bin; bin < last_bin; ++bin)
    for (const Item& w : bins[bin]) {
      if (w.kv_head < 0) {
        const int64_t row = starts[w.seq];
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (decode16) {
            decode_sequence_bf16(qp + row * q_row, q_head, kp, vp, kv_slot, kv_head_stride, tables + w.seq * table_width,
                                 block_size, lens[w.seq], span, kpad, num_kv_heads, group, D, fscale, op + row * o_row,
                                 o_head, scratch16);
            continue;
          }
        }
        decode_sequence(qp + row * q_row, q_head, kp, vp, kv_slot, kv_head_stride, tables + w.seq * table_width,
                        block_size, lens[w.seq], span, kpad, num_kv_heads, group, D, fscale, op + row * o_row, o_head,
                        scratch);
        continue;
      }
      const int64_t q_len = starts[w.seq + 1] - starts[w.seq];
      const int64_t ctx = lens[w.seq];
      const int64_t nq = (w.row_end - w.row_begin) * group;
      const bool by_key = nq < kRows;                                  // a decode row: few query vectors
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
      std::fill(m.begin(), m.begin() + nq, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + nq, 0.0f);
      const int64_t last_pos = ctx - q_len + w.row_end - 1;            // the tile's last query
      const int64_t* table = tables + w.seq * table_width;
      for (int64_t b0 = 0; b0 <= last_pos; b0 += span) {
        const int64_t n = std::min(span, last_pos + 1 - b0);           // keys used in this span
        // Keys and values of the span, block by block (one table lookup per block). A decode
        // row reads fp32 rows in place and converts other dtypes into kT/vb row by row; a
        // query tile gets K transposed into kT for the outer-product scores.
        for (int64_t t = 0; t < n;) {
          const int64_t pos = b0 + t, in_block = std::min(block_size - pos % block_size, n - t);
          const int64_t first = table[pos / block_size] * block_size + pos % block_size;
          for (int64_t e = 0; e < in_block; ++e, ++t) {
            const int64_t off = (first + e) * kv_slot + w.kv_head * kv_head_stride;
            if constexpr (bf16_tiles) {
              if (packed) {
                pack_key_bf16(kp + off, kP.data(), t, kpad16, D);
                vsrc[t] = vp + off;
                continue;
              }
            }
            if (by_key && std::is_same_v<scalar_t, float>) {
              krow[t] = reinterpret_cast<const float*>(kp + off);
              vrow[t] = reinterpret_cast<const float*>(vp + off);
              continue;
            }
            if (by_key) {
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) kT[t * D + d] = static_cast<float>(kp[off + d]);
            } else {
              for (int64_t d = 0; d < D; ++d) kT[d * kpad + t] = static_cast<float>(kp[off + d]);
            }
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) vb[t * D + d] = static_cast<float>(vp[off + d]);
          }
        }
        if constexpr (bf16_tiles) {
          if (packed)
            for (int64_t t = 0; t < n; t += 2)
              pack_values_bf16(vsrc[t], t + 1 < n ? vsrc[t + 1] : nullptr, vP.data() + t / 2 * D, D);
        }
        for_row_groups(nq, [&]<int R>(int64_t i) {                     // keys >= n: never read
          if constexpr (bf16_tiles) {
            if (packed) return scores_rows_bf16<R>(qb.data() + i * D, kP.data(), s.data() + i * kpad, kpad, kpad16, D, fscale);
          }
          if (by_key) scores_rows_by_key<R>(qf.data() + i * D, krow.data(), s.data() + i * kpad, kpad, n, D);
          else scores_rows<R>(qf.data() + i * D, kT.data(), s.data() + i * kpad, kpad, D);
        });
        // Online softmax per query row: s becomes the span's probabilities (0 past the row's
        // causal cut), alpha the rescale of what was accumulated.
        for (int64_t i = 0; i < nq; ++i) {
          float* si = s.data() + i * kpad;
          const int64_t visible = std::max<int64_t>(0, std::min(n, qpos[i] + 1 - b0));   // causal cut
          if (visible == 0) {
            std::fill(si, si + n, 0.0f);
            alpha[i] = 1.0f;
            continue;
          }
          const float sum = softmax_span(si, n, visible, m[i], alpha[i]);
          l[i] = l[i] * alpha[i] + sum;
        }
        if constexpr (bf16_tiles) {
          if (packed)
            for (int64_t i = 0; i < nq; ++i) round_probs_bf16(s.data() + i * kpad, pb.data() + i * kpad16, n);
        }
        for_row_groups(nq, [&]<int R>(int64_t i) {
          if constexpr (bf16_tiles) {
            if (packed) return values_rows_bf16<R>(pb.data() + i * kpad16, alpha.data() + i, vP.data(), acc.data() + i * D, kpad16, n, D);
          }
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
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(ai[d] * inv);
        }
      }
    }
  });
}

// q [N, H, D] (any row/head strides, unit stride over D); k_pool/v_pool [S, H_kv, D] one
// layer's pool; block_tables [B, W] int64; q_start [B + 1] int64; ctx_lens [B] int64;
// out [N, H, D] written for every row that some sequence owns.
void paged_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                     const torch::Tensor& block_tables, const torch::Tensor& q_start,
                     const torch::Tensor& ctx_lens, int64_t block_size, double scale, torch::Tensor out) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3 && out.dim() == 3, "paged_attention: 3-d q/pool/out");
  TORCH_CHECK(q.stride(2) == 1 && k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && out.stride(2) == 1,
              "paged_attention: head_dim must be contiguous");
  TORCH_CHECK(k_pool.strides() == v_pool.strides() && k_pool.sizes() == v_pool.sizes(), "paged_attention: K and V pools differ");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == out.scalar_type(), "paged_attention: one dtype");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0 && q.size(2) == k_pool.size(2), "paged_attention: head shapes");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous() && block_tables.dim() == 2,
              "paged_attention: block_tables int64 [B, W]");
  TORCH_CHECK(q_start.scalar_type() == torch::kLong && ctx_lens.scalar_type() == torch::kLong &&
              q_start.is_contiguous() && ctx_lens.is_contiguous(), "paged_attention: q_start/ctx_lens int64");
  const int64_t num_seqs = ctx_lens.size(0);
  TORCH_CHECK(q_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "paged_attention: batch sizes");
  const int64_t* starts = q_start.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t num_kv_heads = k_pool.size(1), group = q.size(1) / num_kv_heads;
  // With AVX-512, a decode row of few query heads per KV head is one item for all its heads.
  const bool whole_decode = kDecode512 && group < kRows && q.size(2) % 16 == 0 && q.scalar_type() != at::kDouble;
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b] && starts[b + 1] <= q.size(0), "paged_attention: bad q_start/ctx_lens");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= block_tables.size(1), "paged_attention: block table too short");
    if (whole_decode && q_len == 1) {
      items.push_back({b, -1, 0, 1});
      continue;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t r = 0; r < q_len; r += kQueryTile)
        items.push_back({b, h, r, std::min(q_len, r + kQueryTile)});
  }
  // at::parallel_for hands each thread one contiguous range, so items are first dealt into
  // one bin per thread, longest first, each to the least loaded bin (contexts are ragged).
  // With enough sequences to go round, a sequence's items (its KV heads) are dealt together and
  // run back to back: they read the same blocks (the heads of a slot are adjacent in memory),
  // which then come from cache rather than memory.
  const int64_t threads = at::get_num_threads();
  const bool by_seq = num_seqs >= 2 * threads;
  std::vector<std::pair<int64_t, int64_t>> groups;                      // [first, last) items
  std::vector<int64_t> cost;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& w = items[i];
    const int64_t q_len = starts[w.seq + 1] - starts[w.seq];
    const int64_t c = (w.row_end - w.row_begin) * (lens[w.seq] - q_len + w.row_end) * (w.kv_head < 0 ? num_kv_heads : 1);
    if (by_seq && !groups.empty() && items[groups.back().first].seq == w.seq) {
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    run<scalar_t>(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, out, bins);
  });
}

}  // namespace

// Registered as a torch operator (not a Python binding) so that a call costs the dispatcher's
// few microseconds: through a Python-defined custom op it cost ~150 us, 30 times a step.
TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor q_start, "
        "Tensor ctx_lens, int block_size, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) { m.impl("paged_attention", &paged_attention); }
