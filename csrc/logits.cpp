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
#include <tuple>
#include <utility>
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

// Plain sampling's draw (engine/sampler.py, rows without a top-k or top-p cut): row r's token for
// one uniform u[r] in [0, 1) from softmax(logits[r] / temps[r]), the first column whose running
// sum of exp(y - max) exceeds u[r] times their total, without the [K, V] distribution and its
// cumulative sums: torch's softmax and cumsum on one thread took ~80 us a row over SmolLM2's
// vocabulary, and served at temperature 1 (the API's default) the sampling frames were ~4 % of
// the engine thread (py-spy, one GuideLLM stream, Zen 4 host, 2026-12-06).
// The columns go in spans the pool's threads take: each span's max, then the sum of its exps,
// lanes reduced in a fixed order, so a row's token does not depend on which thread ran which
// span or on the rows beside it. Then, on the calling thread, the span where the running sum of
// span sums (column order) first exceeds u * total, its exps made again the same way, and the
// first of its columns whose running sum does; where rounding leaves that scan short, the span's
// last column with a non-zero exp: never a column of zero probability. A row whose max is not
// finite (a NaN, +inf, or every column -inf) takes its argmax as argmax_rows gives it.
struct DrawRow {
  const float* x;
  float t;                                                  // temperature; 1: x as it is
  vec16 y16(int64_t i) const { const vec16 v = load16(x + i); return t == 1.0f ? v : v / t; }
  float y1(int64_t i) const { return t == 1.0f ? x[i] : x[i] / t; }   // as torch's division gives it

  // exp(y - max) of columns [lo, hi) into e[0, hi - lo) (zero below 2^-126); returns their sum.
  float span_exps(int64_t lo, int64_t hi, float max, float* e) const {
    const vec16 mv = vec16{} + max, floor = vec16{} - 87.0f, zero = {};
    vec16 acc = {};
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
      const vec16 d = y16(i) - mv;
      const vec16 v = d < floor ? zero : streamgate::cpu::exp16_nonpositive(d);
      std::memcpy(e + (i - lo), &v, sizeof v);
      acc += v;
    }
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += acc[l];
    for (; i < hi; ++i) {
      const float d = y1(i) - max;
      e[i - lo] = d < -87.0f ? 0.0f : streamgate::cpu::exp16_nonpositive(vec16{} + d)[0];
      sum += e[i - lo];
    }
    return sum;
  }
};

torch::Tensor draw_rows(const torch::Tensor& logits, const torch::Tensor& temps, const torch::Tensor& u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
              logits.scalar_type() == torch::kFloat && logits.size(1) > 0,
              "draw_rows: logits must be [K, V] fp32 on the CPU, unit stride over V, V > 0");
  const int64_t rows = logits.size(0), cols = logits.size(1), spans = (cols + kSpan - 1) / kSpan;
  for (const auto* t : {&temps, &u})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->size(0) == rows && t->scalar_type() == torch::kFloat &&
                t->is_contiguous(), "draw_rows: temps and u must be [K] fp32, one per row");
  const float *x = logits.data_ptr<float>(), *tp = temps.data_ptr<float>(), *up = u.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  int64_t* tokens = out.data_ptr<int64_t>();
  std::vector<float> top(rows * spans), sums(rows * spans), row_max(rows);
  auto row = [&](int64_t r) { return DrawRow{x + r * stride, tp[r]}; };
  // Each span's max of x (argmax_rows' span_best; a NaN wins), then the row's, divided by T: the
  // division is monotone, so that is the max of y.
  streamgate::cpu::parallel_for(0, rows * spans, 1, [&](int64_t a, int64_t b) {
    for (int64_t w = a; w < b; ++w) {
      const int64_t lo = (w % spans) * kSpan;
      const Best best = span_best(x + (w / spans) * stride, lo, std::min(cols, lo + kSpan));
      top[w] = best.nan ? std::numeric_limits<float>::quiet_NaN() : best.v;
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    float m = top[r * spans];
    for (int64_t s = 1; s < spans; ++s) m = std::isnan(top[r * spans + s]) || top[r * spans + s] > m ? top[r * spans + s] : m;
    row_max[r] = tp[r] == 1.0f ? m : m / tp[r];
  }
  streamgate::cpu::parallel_for(0, rows * spans, 1, [&](int64_t a, int64_t b) {
    float e[kSpan];
    for (int64_t w = a; w < b; ++w) {
      const int64_t r = w / spans, lo = (w % spans) * kSpan;
      if (std::isfinite(row_max[r])) sums[w] = row(r).span_exps(lo, std::min(cols, lo + kSpan), row_max[r], e);
    }
  });
  std::vector<float> e(kSpan);
  for (int64_t r = 0; r < rows; ++r) {
    if (!std::isfinite(row_max[r])) {
      argmax_rows_impl(x + r * stride, 1, cols, stride, tokens + r);
      continue;
    }
    float total = 0.0f;
    for (int64_t s = 0; s < spans; ++s) total += sums[r * spans + s];
    const float target = up[r] * total;
    int64_t s = 0;
    float run = 0.0f;
    for (; s + 1 < spans && run + sums[r * spans + s] <= target; ++s) run += sums[r * spans + s];
    auto exps = [&](int64_t span) {
      const int64_t lo = span * kSpan, hi = std::min(cols, lo + kSpan);
      row(r).span_exps(lo, hi, row_max[r], e.data());
      return std::pair<int64_t, int64_t>{lo, hi};
    };
    auto [lo, hi] = exps(s);
    int64_t pick = -1, last = -1;
    for (int64_t i = lo; i < hi; ++i) {
      if (e[i - lo] == 0.0f) continue;
      last = i;
      run += e[i - lo];
      if (run > target) {
        pick = i;
        break;
      }
    }
    while (pick < 0 && last < 0 && s > 0) {      // a last span of zero exps (u * total rounded up to the total)
      std::tie(lo, hi) = exps(--s);
      for (int64_t i = hi - 1; i >= lo && last < 0; --i)
        if (e[i - lo] > 0.0f) last = i;
    }
    tokens[r] = pick >= 0 ? pick : std::max<int64_t>(last, 0);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("logits_fp32(Tensor x) -> Tensor");
  m.def("draw_rows(Tensor logits, Tensor temps, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("logits_fp32", &logits_fp32);
  m.impl("draw_rows", &draw_rows);
}
