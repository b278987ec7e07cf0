// The KV cache's write on the CPU: a step's new keys and values into the paged pool at their
// slots, both in one call.
//
// The pool's write was two index_copy_ calls a layer (PagedKVCache.write); at a few rows each
// cost ~11 us of dispatch and TensorIterator set-up for a few hundred bytes, ~5 % of SmolLM2's
// one-row decode step and ~3 % of a 32-row one (torch.profiler, Zen 4, 2026-12-04). Here each
// (token, KV head) is one memcpy of head_dim elements from the step's K/V, which may be views
// of the packed q/k/v output (any token and head strides, unit stride over head_dim). An int8
// pool (kv_int8.h: [slots, H_kv, head_dim + 4]) gets each row quantized with its scale instead.
#include <torch/extension.h>

#include <cstring>

#include "parallel.h"

#include "kv_int8.h"

namespace {

using streamgate::cpu::kScaleBytes;

bool is_int8(const torch::Tensor& pool) { return pool.scalar_type() == torch::kChar; }

void check(const torch::Tensor& pool, const torch::Tensor& x, const char* name) {
  TORCH_CHECK(pool.device().is_cpu() && pool.dim() == 3 && pool.is_contiguous(),
              "write_kv: ", name, " pool must be a contiguous [slots, H_kv, D] CPU tensor");
  const int64_t row = x.dim() == 3 ? x.size(2) + (is_int8(pool) ? kScaleBytes : 0) : -1;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.size(1) == pool.size(1) && row == pool.size(2) &&
              x.stride(2) == 1 && (x.scalar_type() == pool.scalar_type() || is_int8(pool)),
              "write_kv: ", name, " must be [N, H_kv, D] of the pool's dtype and head shape (an int8 pool: "
              "[slots, H_kv, D + 4]), unit stride over D");
}

// The int8 pool's write: each (token, head) row quantized into its slot (kv_int8.h).
template <typename T>
void quantize_rows(torch::Tensor& pool, const torch::Tensor& x, const int64_t* sp) {
  const int64_t n = x.size(0), heads = x.size(1), D = x.size(2), row = pool.size(2);
  int8_t* dst = pool.data_ptr<int8_t>();
  const T* src = x.data_ptr<T>();
  streamgate::cpu::parallel_for(0, n, 8, [&](int64_t i0, int64_t i1) {     // as the bf16 rows below
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t h = 0; h < heads; ++h)
        streamgate::cpu::quantize_row(src + i * x.stride(0) + h * x.stride(1), dst + (sp[i] * heads + h) * row, D);
  });
}

// k_pool[slots[i]] = k[i] and v_pool[slots[i]] = v[i] for every token i.
void write_kv(torch::Tensor k_pool, torch::Tensor v_pool, const torch::Tensor& slots, const torch::Tensor& k,
              const torch::Tensor& v) {
  check(k_pool, k, "k");
  check(v_pool, v, "v");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type() && k.size(0) == v.size(0),
              "write_kv: K and V differ in shape or dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.is_contiguous() &&
              slots.size(0) == k.size(0), "write_kv: slots must be int64 [N]");
  const int64_t n = k.size(0), heads = k.size(1), D = k.size(2), num_slots = k_pool.size(0);
  const int64_t bytes = D * k.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "write_kv: slot ", sp[i], " outside the pool's ", num_slots);
  if (is_int8(k_pool)) {
    TORCH_CHECK(k.scalar_type() == v.scalar_type(), "write_kv: K and V differ in dtype");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
      quantize_rows<scalar_t>(k_pool, k, sp);
      quantize_rows<scalar_t>(v_pool, v, sp);
    });
    return;
  }
  struct Side { char* dst; const char* src; int64_t s0, s1; };
  const int64_t e = k.element_size();
  const Side sides[2] = {{static_cast<char*>(k_pool.data_ptr()), static_cast<const char*>(k.data_ptr()),
                          k.stride(0) * e, k.stride(1) * e},
                         {static_cast<char*>(v_pool.data_ptr()), static_cast<const char*>(v.data_ptr()),
                          v.stride(0) * e, v.stride(1) * e}};
  // Tokens split over the kernels' threads: each row lands on a line of the pool not written
  // since its block was last used, so a write is a read-for-ownership miss; two threads keep
  // twice as many in flight (Intel AMX host, 30 layers, pool in memory: a 512-token chunk
  // 2.76 -> 1.50 ms on the elastic pool, 32 decode rows 0.24 -> 0.19 ms, 2026-12-05).
  streamgate::cpu::parallel_for(0, n, 8, [&](int64_t i0, int64_t i1) {
    for (const Side& s : sides)
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(s.dst + (sp[i] * heads + h) * bytes, s.src + i * s.s0 + h * s.s1, bytes);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("write_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("write_kv", &write_kv);
}
