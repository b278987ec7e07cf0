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
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 32;   // query rows of one sequence per work item
constexpr int64_t kLanes = 8;        // fp32 lanes of one vector (AVX2: one register)
constexpr int64_t kRows = 4;         // query vectors per step of the score microkernel
constexpr int64_t kSpan = 64;        // keys per online-softmax step (whole blocks, at least one)

typedef float vec8 __attribute__((vector_size(32)));   // GCC/Clang vector extension

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0 (softmax arguments), Cephes' expf: 2^n * p(r) with |r| <= ln2 / 2, relative
// error ~1e-7. Plain float code so that `omp simd` loops over it vectorize (std::exp does not).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);                                  // 2^-126 is the smallest normal float
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Item {
  int64_t seq, kv_head, row_begin, row_end;   // rows counted from the sequence's first row
};

// S[i, t] = q_i . k_t for i < nq (a multiple of kRows; the padding rows of q are zeros) and
// t < kpad (a multiple of kLanes): a tile of queries times a block of keys, as outer products,
// so that every key vector loaded serves kRows queries and nothing is reduced across lanes.
inline void block_scores(const float* q, const float* kT, float* s, int64_t nq, int64_t kpad, int64_t D) {
  for (int64_t i = 0; i < nq; i += kRows) {
    const float* q0 = q + i * D;
    const float *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
    float* s0 = s + i * kpad;
    float *s1 = s0 + kpad, *s2 = s1 + kpad, *s3 = s2 + kpad;
    int64_t t = 0;
    for (; t + 2 * kLanes <= kpad; t += 2 * kLanes) {     // 4 queries x 16 keys: 8 accumulators
      vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
      for (int64_t d = 0; d < D; ++d) {
        const vec8 k = load8(kT + d * kpad + t), k2 = load8(kT + d * kpad + t + kLanes);
        a0 += q0[d] * k; b0 += q0[d] * k2;
        a1 += q1[d] * k; b1 += q1[d] * k2;
        a2 += q2[d] * k; b2 += q2[d] * k2;
        a3 += q3[d] * k; b3 += q3[d] * k2;
      }
      store8(s0 + t, a0); store8(s0 + t + kLanes, b0);
      store8(s1 + t, a1); store8(s1 + t + kLanes, b1);
      store8(s2 + t, a2); store8(s2 + t + kLanes, b2);
      store8(s3 + t, a3); store8(s3 + t + kLanes, b3);
    }
    for (; t < kpad; t += kLanes) {
      vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t d = 0; d < D; ++d) {
        const vec8 k = load8(kT + d * kpad + t);
        a0 += q0[d] * k;
        a1 += q1[d] * k;
        a2 += q2[d] * k;
        a3 += q3[d] * k;
      }
      store8(s0 + t, a0); store8(s1 + t, a1); store8(s2 + t, a2); store8(s3 + t, a3);
    }
  }
}

// acc_i = alpha_i * acc_i + sum_t p_i[t] v_t for kRows query rows at a time over n keys of one
// block: each V vector loaded serves kRows rows, and the accumulators stay in registers over t.
inline void block_values(const float* p, const float* alpha, const float* vb, float* acc, int64_t nq,
                         int64_t kpad, int64_t n, int64_t D) {
  for (int64_t i = 0; i < nq; i += kRows) {
    const float* p0 = p + i * kpad;
    const float *p1 = p0 + kpad, *p2 = p1 + kpad, *p3 = p2 + kpad;
    float* c0 = acc + i * D;
    float *c1 = c0 + D, *c2 = c1 + D, *c3 = c2 + D;
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      vec8 a0 = load8(c0 + d) * alpha[i], a1 = load8(c1 + d) * alpha[i + 1];
      vec8 a2 = load8(c2 + d) * alpha[i + 2], a3 = load8(c3 + d) * alpha[i + 3];
      for (int64_t t = 0; t < n; ++t) {
        const vec8 v = load8(vb + t * D + d);
        a0 += p0[t] * v;
        a1 += p1[t] * v;
        a2 += p2[t] * v;
        a3 += p3[t] * v;
      }
      store8(c0 + d, a0); store8(c1 + d, a1); store8(c2 + d, a2); store8(c3 + d, a3);
    }
    for (; d < D; ++d) {                                    // head_dim not a multiple of kLanes
      for (int64_t j = 0; j < kRows; ++j) {
        float a = acc[(i + j) * D + d] * alpha[i + j];
        for (int64_t t = 0; t < n; ++t) a += p[(i + j) * kpad + t] * vb[t * D + d];
        acc[(i + j) * D + d] = a;
      }
    }
  }
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
  // Keys are taken `span` at a time (whole blocks) so that the softmax bookkeeping per query
  // row is paid once per span, not once per (small) block.
  const int64_t span = std::max<int64_t>(1, kSpan / block_size) * block_size;
  const int64_t kpad = (span + kLanes - 1) / kLanes * kLanes;             // keys per span, padded
  const int64_t max_q = (kQueryTile * group + kRows - 1) / kRows * kRows;  // query vectors per item, padded

  at::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t first_bin, int64_t last_bin) {
    // qf [max_q, D] scaled queries; kT [D, kpad] one span of K transposed; vb [kpad, D] its V;
    // s [max_q, kpad] scores, then probabilities; acc [max_q, D] unnormalized outputs; m, l, alpha
    // the online softmax's running max, running sum and this span's rescale, per query vector.
    std::vector<float> qf(max_q * D), acc(max_q * D), m(max_q), l(max_q), alpha(max_q), s(max_q * kpad);
    std::vector<float> kT(D * kpad, 0.0f), vb(kpad * D);
    std::vector<int64_t> qpos(max_q);
    for (int64_t bin = first_bin; bin < last_bin; ++bin)
    for (const Item& w : bins[bin]) {
      const int64_t q_len = starts[w.seq + 1] - starts[w.seq];
      const int64_t ctx = lens[w.seq];
      const int64_t nq = (w.row_end - w.row_begin) * group;
      const int64_t nq_pad = (nq + kRows - 1) / kRows * kRows;
      // Query vectors of the tile, scaled, fp32: index i = row * group + g.
      std::fill(qf.begin() + nq * D, qf.begin() + nq_pad * D, 0.0f);
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
      std::fill(acc.begin(), acc.begin() + nq_pad * D, 0.0f);
      std::fill(m.begin(), m.begin() + nq, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + nq, 0.0f);
      const int64_t last_pos = ctx - q_len + w.row_end - 1;            // the tile's last query
      const int64_t* table = tables + w.seq * table_width;
      for (int64_t b0 = 0; b0 <= last_pos; b0 += span) {
        const int64_t n = std::min(span, last_pos + 1 - b0);           // keys used in this span
        for (int64_t t = 0; t < n; ++t) {
          const int64_t pos = b0 + t, slot = table[pos / block_size] * block_size + pos % block_size;
          const int64_t off = slot * kv_slot + w.kv_head * kv_head_stride;
          for (int64_t d = 0; d < D; ++d) kT[d * kpad + t] = static_cast<float>(kp[off + d]);
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) vb[t * D + d] = static_cast<float>(vp[off + d]);
        }
        block_scores(qf.data(), kT.data(), s.data(), nq_pad, kpad, D);   // keys >= n: never read
        // Online softmax per query row: s becomes the span's probabilities (0 past the row's
        // causal cut, and for the padding rows), alpha the rescale of what was accumulated.
        for (int64_t i = 0; i < nq_pad; ++i) {
          float* si = s.data() + i * kpad;
          const int64_t visible = i < nq ? std::max<int64_t>(0, std::min(n, qpos[i] + 1 - b0)) : 0;   // causal cut
          if (visible == 0) {
            std::fill(si, si + n, 0.0f);
            alpha[i] = i < nq ? 1.0f : 0.0f;
            continue;
          }
          float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
          for (int64_t t = 0; t < visible; ++t) block_max = std::max(block_max, si[t]);
          const float new_m = std::max(m[i], block_max);
          alpha[i] = std::exp(m[i] - new_m);                             // 0 on the first span
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < visible; ++t) {
            si[t] = exp_nonpositive(si[t] - new_m);
            sum += si[t];
          }
          std::fill(si + visible, si + n, 0.0f);
          l[i] = l[i] * alpha[i] + sum;
          m[i] = new_m;
        }
        block_values(s.data(), alpha.data(), vb.data(), acc.data(), nq_pad, kpad, n, D);
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
