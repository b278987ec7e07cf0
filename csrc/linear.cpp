// fp32 linear layers on the CPU: y = x W^T + b with W packed once into column blocks.
//
// A decode step's GEMMs have few rows, so they are bound by reading the weights: SmolLM2's
// 538 MB per step. MKL's sgemm streams them at ~10 GB/s and leaves the second core idle at
// one row; oneDNN's packed matmul reaches ~11 GB/s. Here W [N, K] is packed as [ceil(N/16), K,
// 16]: block j holds outputs 16j..16j+15, K-major, one contiguous stream. The loop is
// linear_blocks.h's register tiles (as the bf16 and int8 kernels', the weights loaded as they
// are): up to 8 rows against up to 6 blocks side by side, one fp32 chain per (row, output)
// over k in order, so a row's bits do not depend on the rows beside it. Until 2026-12-07 it
// ran passes of 4 rows over one block, and Intel CPUs sent steps of more than 4 rows to a
// batched GEMM over the blocks and of 128+ to MKL's GEMM on them transposed; SmolLM2's 120
// layer linears on the Intel Ice Lake host (2 threads, same process, alternating; those forms /
// the tiles): 1 row 19.5 / 17.4 ms, 4 rows 20.2 / 18.0, 8 rows 35.8 / 18.4, 32 rows 71.4 /
// 37.5, 64 rows 118 / 65, 128 rows 186 / 120, 300 rows 363 / 280, 512 rows 486 / 447.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "parallel.h"

#include <algorithm>

#include "linear_blocks.h"

namespace {

constexpr int64_t kBlock = streamgate_linear::kBlock;   // outputs per packed block

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
  using namespace streamgate_linear;
  const auto xc = fp32_rows(x);
  const int64_t M = xc.size(0), K = xc.size(1), N = out_features;
  auto y = torch::empty({M, N}, x.options());
  const Out<float> out{y.data_ptr<float>(), N, nullptr, bias.has_value() ? bias->data_ptr<float>() : nullptr};
  const float* wp = packed.data_ptr<float>();
  if (stream_prefetch_hint() == kPrefetchT0)
    fma_blocks<Fp32Code, kPrefetchT0>(xc.data_ptr<float>(), xc.stride(0), M, K, N, wp, out, packed.size(0), 32 << 10);
  else
    fma_blocks<Fp32Code, kPrefetchNta>(xc.data_ptr<float>(), xc.stride(0), M, K, N, wp, out, packed.size(0), 32 << 10);
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
