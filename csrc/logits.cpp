// The step's logits on the step's threads: widened to fp32 (logits_fp32) and greedy sampling's
// argmax (argmax_rows: each row's index of its first maximum, a NaN counted the maximum (its
// first NaN), as torch's `max(dim=-1).indices` gives it).
//
// Why: served, the elastic pool runs torch's own operators on one thread (engine/elastic.py),
// and over SmolLM2's 49,152-token vocabulary they then cost more than a layer: a 32-row bf16
// decode step spent 1.9 ms in `max(dim=-1)` and 0.9 ms widening the logits to fp32 (Intel AMX
// host, 2026-12-05; the step 44 ms). Widening is a plain split of the rows' columns. For the
// argmax the rows are cut into column spans that
// the pool's threads take (one row can use every thread), each span reduced with whole vectors
// (a NaN found falls back to a scalar scan of that span), and the spans of a row combined in
// column order, so the first maximum wins whatever thread ran which span. Reads bf16 or fp32
// logits in place: the widened copy is not needed for a greedy row.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace {

using streamgate::cpu::vec16;
using streamgate::cpu::vec16i;

constexpr int64_t kSpan = 4096;     // columns per work item (16 KB of fp32: L1-resident)

inline float value(const float* p, int64_t i) { return p[i]; }
inline float value(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

inline vec16 load16(const float* p) { return streamgate::cpu::load_v<vec16>(p); }
inline vec16 load16(const c10::BFloat16* p) { return streamgate::cpu::load_bf16_v<vec16>(p); }

struct Best {
  float v;
  int64_t i;       // -1: an empty span
  bool nan;
};

// The first maximum of p[lo, hi), or its first NaN: one pass of whole vectors, each lane keeping
// its first maximum and where it was (a strict >), then the lowest index among the lanes that
// hold the largest; a NaN seen sends the span to a scalar scan.
template <typename T>
Best span_best(const T* p, int64_t lo, int64_t hi) {
  int64_t i = lo;
  vec16 m = vec16{} - std::numeric_limits<float>::infinity();
  vec16i at = {}, cur = {}, unordered = {};
  for (int l = 0; l < 16; ++l) at[l] = cur[l] = static_cast<int32_t>(l);
  for (; i + 16 <= hi; i += 16, cur += 16) {
    const vec16 x = load16(p + i);
    unordered |= (x != x);
    const vec16i up = x > m;
    m = up ? x : m;
    at = up ? cur : at;
  }
  bool nan = false;
  for (int l = 0; l < 16; ++l) nan |= unordered[l] != 0;
  Best b{-std::numeric_limits<float>::infinity(), lo, false};
  if (i > lo)
    for (int l = 0; l < 16; ++l)
      if (m[l] > b.v || (m[l] == b.v && lo + at[l] < b.i)) b = {m[l], lo + at[l], false};
  for (int64_t j = i; j < hi; ++j) {
    const float x = value(p, j);
    nan |= std::isnan(x);
    if (x > b.v) b = {x, j, false};
  }
  if (nan)
    for (int64_t j = lo; j < hi; ++j)
      if (std::isnan(value(p, j))) return {std::numeric_limits<float>::quiet_NaN(), j, true};
  return b;
}

template <typename T>
void argmax_rows_impl(const T* p, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out) {
  const int64_t spans = std::max<int64_t>(1, (cols + kSpan - 1) / kSpan);
  std::vector<Best> best(rows * spans);
  streamgate::cpu::parallel_for(0, rows * spans, 1, [&](int64_t a, int64_t b) {
    for (int64_t w = a; w < b; ++w) {
      const int64_t r = w / spans, s = w % spans;
      const int64_t lo = s * kSpan, hi = std::min(cols, lo + kSpan);
      best[w] = lo < hi ? span_best(p + r * row_stride, lo, hi) : Best{0.0f, -1, false};
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    Best b = best[r * spans];
    for (int64_t s = 1; s < spans && !b.nan; ++s) {
      const Best& c = best[r * spans + s];
      if (c.i >= 0 && (c.nan || b.i < 0 || c.v > b.v)) b = c;        // later spans win only when larger
    }
    out[r] = std::max<int64_t>(b.i, 0);
  }
}

// x [K, V] bf16 (unit column stride) -> fp32 [K, V], exact, columns split over the threads.
torch::Tensor logits_fp32(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kBFloat16,
              "logits_fp32: x must be [K, V] bf16 on the CPU, unit stride over V");
  const int64_t rows = x.size(0), cols = x.size(1), spans = std::max<int64_t>(1, (cols + kSpan - 1) / kSpan);
  auto out = torch::empty({rows, cols}, x.options().dtype(torch::kFloat));
  const c10::BFloat16* src = x.data_ptr<c10::BFloat16>();
  float* dst = out.data_ptr<float>();
  streamgate::cpu::parallel_for(0, rows * spans, 1, [&](int64_t a, int64_t b) {
    for (int64_t w = a; w < b; ++w) {
      const int64_t r = w / spans, lo = (w % spans) * kSpan, hi = std::min(cols, lo + kSpan);
      const c10::BFloat16* s = src + r * x.stride(0);
      float* d = dst + r * cols;
      int64_t i = lo;
      for (; i + 16 <= hi; i += 16) {
        const vec16 v = load16(s + i);
        std::memcpy(d + i, &v, sizeof v);
      }
      for (; i < hi; ++i) d[i] = static_cast<float>(s[i]);
    }
  });
  return out;
}

// logits [K, V] fp32 or bf16 (unit column stride) -> int64 [K].
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
              (logits.scalar_type() == torch::kFloat || logits.scalar_type() == torch::kBFloat16),
              "argmax_rows: logits must be [K, V] fp32 or bf16 on the CPU, unit stride over V");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: logits must have at least one column");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  if (logits.scalar_type() == torch::kFloat)
    argmax_rows_impl(logits.data_ptr<float>(), rows, cols, logits.stride(0), out.data_ptr<int64_t>());
  else
    argmax_rows_impl(logits.data_ptr<c10::BFloat16>(), rows, cols, logits.stride(0), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("logits_fp32(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("logits_fp32", &logits_fp32);
}
