// Paged attention on the CPU: each query row reads its sequence's keys and values in place,
// block by block through the block table, with an online softmax (no copy of the context).
//
// One call covers a whole packed batch: decode rows (one query each) and prefill chunks (many
// queries over cached context plus themselves). Sequence b owns the packed query rows
// [q_start[b], q_start[b+1]); its context is ctx_lens[b] tokens long and already holds the
// step's new keys/values, so query row j of b sits at position ctx_lens[b] - q_len + j and
// attends causally to positions 0..that. Work is split over (sequence, kv head, query tile)
// so the query heads of a GQA group share each K/V block load. Math is fp32 whatever the
// storage dtype (fp32, bf16, fp16).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;   // query rows of one sequence per work item

struct Item {
  int64_t seq, kv_head, row_begin, row_end;   // rows counted from the sequence's first row
};

template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

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

  at::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t first_bin, int64_t last_bin) {
    const int64_t max_q = kQueryTile * group;
    std::vector<float> qf(max_q * D), acc(max_q * D), m(max_q), l(max_q), s(block_size);
    std::vector<float> kb(block_size * D), vb(block_size * D);
    std::vector<int64_t> qpos(max_q);
    for (int64_t bin = first_bin; bin < last_bin; ++bin)
    for (const Item& w : bins[bin]) {
      const int64_t q_len = starts[w.seq + 1] - starts[w.seq];
      const int64_t ctx = lens[w.seq];
      const int64_t nq = (w.row_end - w.row_begin) * group;
      // Query vectors of the tile, scaled, fp32: index i = row * group + g.
      for (int64_t r = w.row_begin; r < w.row_end; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t i = (r - w.row_begin) * group + g;
          const scalar_t* src = qp + (starts[w.seq] + r) * q_row + (w.kv_head * group + g) * q_head;
          float* dst = qf.data() + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
          qpos[i] = ctx - q_len + r;
        }
      }
      std::fill(acc.begin(), acc.begin() + nq * D, 0.0f);
      std::fill(m.begin(), m.begin() + nq, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + nq, 0.0f);
      const int64_t last_pos = ctx - q_len + w.row_end - 1;            // the tile's last query
      const int64_t* table = tables + w.seq * table_width;
      for (int64_t b0 = 0; b0 <= last_pos; b0 += block_size) {
        const int64_t n = std::min(block_size, last_pos + 1 - b0);     // keys used in this block
        const int64_t base = table[b0 / block_size] * block_size;
        for (int64_t t = 0; t < n; ++t) {
          const int64_t off = (base + t) * kv_slot + w.kv_head * kv_head_stride;
          to_float(kp + off, kb.data() + t * D, D);
          to_float(vp + off, vb.data() + t * D, D);
        }
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t visible = std::min(n, qpos[i] + 1 - b0);          // causal cut in this block
          if (visible <= 0) continue;
          const float* qi = qf.data() + i * D;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < visible; ++t) {
            const float* kt = kb.data() + t * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qi[d] * kt[d];
            s[t] = dot;
            block_max = std::max(block_max, dot);
          }
          const float new_m = std::max(m[i], block_max);
          const float alpha = std::exp(m[i] - new_m);                    // 0 on the first block
          float* ai = acc.data() + i * D;
          float sum = 0.0f;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ai[d] *= alpha;
          for (int64_t t = 0; t < visible; ++t) {
            const float p = std::exp(s[t] - new_m);
            sum += p;
            const float* vt = vb.data() + t * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ai[d] += p * vt[d];
          }
          l[i] = l[i] * alpha + sum;
          m[i] = new_m;
        }
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
  const int64_t num_kv_heads = k_pool.size(1);
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b] && starts[b + 1] <= q.size(0), "paged_attention: bad q_start/ctx_lens");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= block_tables.size(1), "paged_attention: block table too short");
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t r = 0; r < q_len; r += kQueryTile)
        items.push_back({b, h, r, std::min(q_len, r + kQueryTile)});
  }
  // at::parallel_for hands each thread one contiguous range, so items are first dealt into
  // one bin per thread, longest first, each to the least loaded bin (contexts are ragged).
  std::vector<int64_t> cost(items.size()), order(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& w = items[i];
    const int64_t q_len = starts[w.seq + 1] - starts[w.seq];
    cost[i] = (w.row_end - w.row_begin) * (lens[w.seq] - q_len + w.row_end);
    order[i] = static_cast<int64_t>(i);
  }
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  const int64_t num_bins = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::vector<std::vector<Item>> bins(num_bins);
  std::vector<int64_t> load(num_bins, 0);
  for (int64_t i : order) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    bins[b].push_back(items[i]);
    load[b] += cost[i];
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    run<scalar_t>(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, out, bins);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over block tables (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
