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
//
// The pools may also be int8 (EngineConfig.kv_cache_dtype "int8"): rows of head_dim values and
// an fp32 scale (kv_int8.h), half the bytes a decode row reads, for the same queries and outputs.
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "attention_run.h"

namespace {

using namespace streamgate::cpu;

// q [N, H, D] (any row/head strides, unit stride over D); k_pool/v_pool [S, H_kv, D] one
// layer's pool (or int8 [S, H_kv, D + 4]); block_tables [B, W] int64; q_start [B + 1] int64; ctx_lens [B] int64;
// out [N, H, D] written for every row that some sequence owns. window (0: none), softcap (0:
// none) and sinks ([H] fp32, or none): the layer's features (Features, attention_tiles.h).
// Whether bf16 query tiles run on AMX in this call: where this process may, for head_dim % 32 == 0,
// without soft-capping (the call and attention_work's view of its deal both ask here).
bool query_tiles_on_amx(const torch::Tensor& q, double softcap) {
  return kAmxBuilt && q.scalar_type() == at::kBFloat16 && q.size(2) % 32 == 0 && softcap == 0.0 &&
         amx_switch().load(std::memory_order_relaxed);
}

void paged_attention_ext(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                         const torch::Tensor& block_tables, const torch::Tensor& q_start, const torch::Tensor& ctx_lens,
                         int64_t block_size, double scale, int64_t window, double softcap,
                         const std::optional<torch::Tensor>& sinks, torch::Tensor out) {
  check_inputs(q, k_pool, v_pool, block_tables, q_start, ctx_lens, out);
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention: window and softcap must be >= 0");
  Features f{window, static_cast<float>(softcap), nullptr};
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == torch::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                sinks->size(0) == q.size(1), "paged_attention: sinks fp32 [num_heads]");
    f.sinks = sinks->data_ptr<float>();
  }
  const bool use_amx = query_tiles_on_amx(q, softcap);
  const std::vector<std::vector<Item>> bins =
      deal_items(q, k_pool, block_tables, q_start, ctx_lens, block_size, use_amx ? kQueryTileAmx : kQueryTile, window);
  if (k_pool.scalar_type() == torch::kChar) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
      if constexpr (!std::is_same_v<scalar_t, double>)     // check_inputs refused fp64 queries
        run_attention<scalar_t, int8_t>(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, f,
                                        out, bins, use_amx);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    run_attention<scalar_t>(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, f, out, bins,
                            use_amx);
  });
}

void paged_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                     const torch::Tensor& block_tables, const torch::Tensor& q_start,
                     const torch::Tensor& ctx_lens, int64_t block_size, double scale, torch::Tensor out) {
  paged_attention_ext(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, 0, 0.0, std::nullopt, out);
}

// How a call with these inputs deals its work to the threads (deal_items): one row per item,
// [bin, sequence, KV head (-1: a decode row's heads h0..h1), first row, end row, h0, h1, and a
// decode row's keys k0..k1, cut into parts, of which the item runs p0..p1].
torch::Tensor attention_work(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& block_tables,
                             const torch::Tensor& q_start, const torch::Tensor& ctx_lens, int64_t block_size) {
  check_inputs(q, k_pool, k_pool, block_tables, q_start, ctx_lens, q);
  const bool use_amx = query_tiles_on_amx(q, 0.0);
  const auto bins = deal_items(q, k_pool, block_tables, q_start, ctx_lens, block_size,
                               use_amx ? kQueryTileAmx : kQueryTile);
  std::vector<int64_t> rows;
  for (size_t b = 0; b < bins.size(); ++b)
    for (const Item& w : bins[b])
      rows.insert(rows.end(), {static_cast<int64_t>(b), w.seq, w.kv_head, w.row_begin, w.row_end, w.h0, w.h1, w.k0,
                               w.k1, w.parts, w.p0, w.p1});
  return torch::tensor(rows, torch::kLong).view({-1, 12});
}

// Whether this process runs AMX tiles: bf16 pools' query tiles (attention_amx_item.h) and bf16
// rows of the int8 and bf16 linears past their minimum (linear_amx.h); `enable` turns them on
// (where this process may run AMX tiles) or off, for every later call in the process.
bool amx_tiles(std::optional<bool> enable) {
  if (enable.has_value()) amx_switch().store(*enable && amx_supported());
  return amx_switch().load();
}

// Whether decode rows load the next span's K/V (true) or prefetch it (attention_decode.h);
// `enable` sets it for every later call in the process (benchmarks compare the two).
bool decode_span_loads_op(std::optional<bool> enable) {
#ifdef __AVX512F__
  if (enable.has_value()) decode_span_loads().store(*enable);
  return decode_span_loads().load();
#else
  return false;                          // the AVX2 / portable decode rows use neither
#endif
}

// Whether decode rows of 4 * kPartKeys (256) keys or more are cut into parts (attention_parts.h);
// `enable` sets it for every later call in the process (benchmarks compare the two; the outputs
// differ in rounding).
bool decode_parts_op(std::optional<bool> enable) {
  if (enable.has_value()) decode_parts_switch().store(*enable);
  return decode_parts_switch().load();
}

}  // namespace

// Registered as a torch operator (not a Python binding) so that a call costs the dispatcher's
// few microseconds: through a Python-defined custom op it cost ~150 us, 30 times a step.
TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor q_start, "
        "Tensor ctx_lens, int block_size, float scale, Tensor(a!) out) -> ()");
  m.def("paged_attention_ext(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor q_start, "
        "Tensor ctx_lens, int block_size, float scale, int window, float softcap, Tensor? sinks, Tensor(a!) out) -> ()");
  m.def("amx_tiles(bool? enable=None) -> bool", &amx_tiles);
  m.def("attention_work(Tensor q, Tensor k_pool, Tensor block_tables, Tensor q_start, Tensor ctx_lens, "
        "int block_size) -> Tensor", &attention_work);
  m.def("decode_span_loads(bool? enable=None) -> bool", &decode_span_loads_op);
  m.def("decode_parts(bool? enable=None) -> bool", &decode_parts_op);
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_ext", &paged_attention_ext);
}
