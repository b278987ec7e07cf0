// fp32 linear layers on the CPU: y = x W^T + b with W packed once into column blocks.
//
// A decode step's GEMMs have few rows, so they are bound by reading the weights: SmolLM2's
// 538 MB per step. MKL's sgemm streams them at ~10 GB/s and leaves the second core idle at
// one row; oneDNN's packed matmul reaches ~11 GB/s. This machine reads ~20 GB/s on two cores.
// Here W [N, K] is packed as [ceil(N/16), K, 16]: block j holds outputs 16j..16j+15, K-major,
// so a block is one contiguous stream and each 16-wide row of it is two vector loads that
// serve up to four query rows (8 accumulators in registers, no reduction across lanes). Blocks
// are split over the threads. Measured on SmolLM2's shapes (docs/BENCHMARKS.md §8.13): 1.5x
// oneDNN at 1 row, 2x at 4, 1.7x at 8, 1.2x at 32, within 3 % at 128-512 rows (there both are
// bound by the FMA units). Summation over K is in order, one accumulator per output lane.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "parallel.h"

#include <algorithm>

#include "simd.h"

namespace {

using namespace streamgate::cpu;

constexpr int64_t kBlock = 16;   // outputs per packed block: two AVX2 registers
constexpr int64_t kRows = 4;     // query rows per pass over a block

// The weight stream's software prefetch, by vendor (simd.h's intel_cpu): prefetcht0 8 KB ahead on
// Intel's CPUs, prefetchnta 2 KB ahead elsewhere (this kernel's form since it was written; the
// Intel form is not measured on an AMD CPU). SmolLM2's 120 layer linears at one row (424 MB from
// memory, 2 threads, Intel Ice Lake host, 2026-12-07; a plain read of 512 MB ran 22 GB/s):
// prefetchnta 2 KB 44.2 ms (9.6 GB/s), prefetcht0 4 KB 26.5, prefetcht0 8 KB 21.0 (20.3 GB/s);
// 4 rows 34.1 -> 22.3 ms.
struct NearNta {
  static constexpr int64_t kAhead = 32, kLocality = 0;     // rows of kBlock floats ahead: 2 KB
};
struct FarT0 {
  static constexpr int64_t kAhead = 128, kLocality = 3;    // 8 KB
};

// y[j, 0:valid] = x[j] . block + bias for R rows j: the block is [K, kBlock], K-major.
template <int R, class Ahead>
inline void block_rows(const float* x, int64_t x_stride, const float* block, int64_t K, const float* bias,
                       float* y, int64_t y_stride, int64_t valid) {
  vec8 lo[R], hi[R];
  for (int j = 0; j < R; ++j) lo[j] = hi[j] = vec8{};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(block + (k + Ahead::kAhead) * kBlock, 0, Ahead::kLocality);
    const vec8 w0 = load8(block + k * kBlock), w1 = load8(block + k * kBlock + 8);
    for (int j = 0; j < R; ++j) {
      const float xv = x[j * x_stride + k];
      lo[j] += xv * w0;
      hi[j] += xv * w1;
    }
  }
  for (int j = 0; j < R; ++j) {
    float tmp[kBlock];
    store8(tmp, lo[j]);
    store8(tmp + 8, hi[j]);
    for (int64_t n = 0; n < valid; ++n) y[j * y_stride + n] = tmp[n] + (bias ? bias[n] : 0.0f);
  }
}

// weight [N, K] fp32 -> packed [ceil(N/16), K, 16], zero past N.
torch::Tensor pack_linear(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kFloat && weight.dim() == 2,
              "pack_linear: weight must be a 2-d fp32 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kBlock - 1) / kBlock;
  auto packed = torch::zeros({blocks, K, kBlock}, weight.options());
  const auto w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t n = b * kBlock; n < std::min(N, (b + 1) * kBlock); ++n)
        for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * kBlock + n % kBlock] = src[n * K + k];
  });
  return packed;
}

// x [M, K] fp32 (unit stride over K), packed from pack_linear, bias [N] or none -> y [M, N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2, "linear: x must be [M, K] fp32");
  TORCH_CHECK(packed.scalar_type() == torch::kFloat && packed.dim() == 3 && packed.size(2) == kBlock &&
              packed.is_contiguous() && packed.size(1) == x.size(1) &&
              packed.size(0) == (out_features + kBlock - 1) / kBlock, "linear: packed weight does not match x");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                                    bias->numel() == out_features), "linear: bias must be [out_features] fp32");
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = out_features, blocks = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t xs = xc.stride(0);
  // At least ~32 KB of weights per task, so small layers do not pay for waking a thread.
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(1, K));
  auto run = [&](auto ahead) {
    using Ahead = decltype(ahead);
    streamgate::cpu::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* block = wp + b * K * kBlock;
        const int64_t n0 = b * kBlock, valid = std::min(kBlock, N - n0);
        const float* bb = bp ? bp + n0 : nullptr;
        float* yb = yp + n0;
        int64_t m = 0;
        for (; m + kRows <= M; m += kRows)
          block_rows<kRows, Ahead>(xp + m * xs, xs, block, K, bb, yb + m * N, N, valid);
        switch (M - m) {
          case 3: block_rows<3, Ahead>(xp + m * xs, xs, block, K, bb, yb + m * N, N, valid); break;
          case 2: block_rows<2, Ahead>(xp + m * xs, xs, block, K, bb, yb + m * N, N, valid); break;
          case 1: block_rows<1, Ahead>(xp + m * xs, xs, block, K, bb, yb + m * N, N, valid); break;
          default: break;
        }
      }
    });
  };
  if (intel_cpu()) run(FarT0{});
  else run(NearNta{});
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
}
