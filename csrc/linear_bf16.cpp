// bf16-weight linear layers on the CPU for steps of few rows: y = x W^T + b, W bf16.
//
// A decode step is bound by reading the weights; oneDNN's prepacked bf16 matmul reaches only
// ~17 GFLOP/s at one row on the Zen 4 host (AVX512-BF16, no AMX), so bf16 decode was
// compute-bound. This kernel reads the weight as the int8 one reads its codes
// (linear_int8.cpp): packed once at load as [ceil(N/16), K, 16] bf16, block j holding outputs
// 16j..16j+15, K-major, one contiguous stream of 32-byte rows. Each row is widened to sixteen
// fp32 lanes in registers by a 16-bit left shift (exact: bf16 is fp32's upper half) and FMA'd
// with the activation, broadcast; accumulation is fp32, the bias is added once at the end and
// the output rounded once to the activation's dtype. One row keeps four independent
// accumulators (k unrolled by 4), four rows share one widened weight row; blocks are split
// over the threads. Activations in bf16/fp16 are converted to fp32 once per call.
//
// It is fp32 FMA-bound above a few rows (Zen 4 retires one 16-lane FMA a cycle; oneDNN's
// VDPBF16PS does twice the MACs): engine/packed_linear.py runs it up to 4 rows and oneDNN's
// prepacked bf16 matmul above.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 16;   // outputs per packed block, as in linear.cpp and linear_int8.cpp
constexpr int64_t kRows = 4;     // query rows per pass over a block

// A block's sixteen lanes are kParts vectors of kLanes fp32: one AVX-512 register, or two
// 8-lane ones (AVX2 registers; GCC/Clang vector extensions elsewhere).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
typedef float lanes_t __attribute__((vector_size(64)));
inline lanes_t widen(const uint16_t* p) {      // bf16 p[0..15] -> fp32 lanes (zero-extend, << 16)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<lanes_t>(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
}
#else
constexpr int kLanes = 8;
typedef float lanes_t __attribute__((vector_size(32)));
inline lanes_t widen(const uint16_t* p) {
#if defined(__AVX2__)
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<lanes_t>(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
#else
  typedef uint16_t halves_t __attribute__((vector_size(16)));
  typedef uint32_t bits_t __attribute__((vector_size(32)));
  halves_t h;
  std::memcpy(&h, p, sizeof h);
  const bits_t bits = __builtin_convertvector(h, bits_t) << 16;
  lanes_t v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
#endif
constexpr int kParts = kBlock / kLanes;

// y[j, 0:valid] = x[j] . block + bias for R rows j; U accumulators per row over k. Not
// inlined, as in linear_int8.cpp: inside parallel_for's lambda GCC kept the accumulators on
// the stack. No software prefetch: a thread's blocks are one contiguous stream, which the
// hardware prefetcher follows; prefetchnta 4 KB ahead (linear_int8.cpp's) cost ~20 % of the
// bandwidth in a standalone loop on the Zen 4 host (2026-12-02).
template <int R, int U, typename T>
__attribute__((noinline)) void block_rows(const float* x, int64_t xs, const uint16_t* block, int64_t K,
                                          const float* bias, T* y, int64_t ys, int64_t valid) {
  lanes_t acc[U][R][kParts];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < R; ++j)
      for (int p = 0; p < kParts; ++p) acc[u][j][p] = lanes_t{};
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u)
      for (int p = 0; p < kParts; ++p) {
        const lanes_t w = widen(block + (k + u) * kBlock + p * kLanes);
        for (int j = 0; j < R; ++j) acc[u][j][p] += x[j * xs + k + u] * w;
      }
  }
  for (; k < K; ++k)
    for (int p = 0; p < kParts; ++p) {
      const lanes_t w = widen(block + k * kBlock + p * kLanes);
      for (int j = 0; j < R; ++j) acc[0][j][p] += x[j * xs + k] * w;
    }
  for (int j = 0; j < R; ++j) {
    float tmp[kBlock];
    for (int p = 0; p < kParts; ++p) {
      lanes_t sum = acc[0][j][p];
      for (int u = 1; u < U; ++u) sum += acc[u][j][p];
      std::memcpy(tmp + p * kLanes, &sum, sizeof sum);
    }
    for (int64_t n = 0; n < valid; ++n) y[j * ys + n] = static_cast<T>(tmp[n] + (bias ? bias[n] : 0.0f));
  }
}

// weight [N, K] bf16 -> packed [ceil(N/16), K, 16] bf16, zero past N.
torch::Tensor pack_bf16(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kBFloat16 && weight.dim() == 2,
              "pack_bf16: weight must be a 2-d bf16 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kBlock - 1) / kBlock;
  auto packed = torch::zeros({blocks, K, kBlock}, weight.options());
  const auto c = weight.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(c.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t n = b * kBlock; n < std::min(N, (b + 1) * kBlock); ++n)
        for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * kBlock + n % kBlock] = src[n * K + k];
  });
  return packed;
}

void check_packed(const torch::Tensor& packed, int64_t N, const char* op) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kBFloat16 && packed.dim() == 3 &&
              packed.size(2) == kBlock && packed.is_contiguous() && packed.size(0) == (N + kBlock - 1) / kBlock,
              op, ": packed weight must be [ceil(N/16), K, 16] bf16 from pack_bf16");
}

template <typename T>
void run_blocks(const float* xp, int64_t xs, int64_t M, int64_t K, int64_t N, const uint16_t* wp,
                const float* bp, T* yp, int64_t blocks) {
  // At least ~32 KB of weights per task, so small layers do not pay for waking a thread.
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(1, K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* block = wp + b * K * kBlock;
      const int64_t n0 = b * kBlock, valid = std::min(kBlock, N - n0);
      const float* bb = bp ? bp + n0 : nullptr;
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows)
        block_rows<kRows, 1>(xp + m * xs, xs, block, K, bb, yp + m * N + n0, N, valid);
      switch (M - m) {
        case 3: block_rows<3, 2>(xp + m * xs, xs, block, K, bb, yp + m * N + n0, N, valid); break;
        case 2: block_rows<2, 2>(xp + m * xs, xs, block, K, bb, yp + m * N + n0, N, valid); break;
        case 1: block_rows<1, 4>(xp + m * xs, xs, block, K, bb, yp + m * N + n0, N, valid); break;
        default: break;
      }
    }
  });
}

// x [M, K] fp32, bf16 or fp16 (any row stride); packed from pack_bf16; bias [N] fp32 or none
// -> y [M, N] in x's dtype, rounded once from the fp32 sum.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "linear_bf16: x must be [M, K] on the CPU");
  const int64_t N = out_features;
  check_packed(packed, N, "linear_bf16");
  TORCH_CHECK(packed.size(1) == x.size(1), "linear_bf16: packed weight does not match x's K");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                                    bias->numel() == N), "linear_bf16: bias must be [out_features] fp32");
  const auto xf = x.scalar_type() == torch::kFloat && x.stride(1) == 1 ? x : x.to(torch::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), blocks = packed.size(0), xs = xf.stride(0);
  auto y = torch::empty({M, N}, x.options().dtype(x.scalar_type()));
  const float* xp = xf.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  switch (x.scalar_type()) {
    case torch::kFloat: run_blocks(xp, xs, M, K, N, wp, bp, y.data_ptr<float>(), blocks); break;
    case torch::kBFloat16: run_blocks(xp, xs, M, K, N, wp, bp, y.data_ptr<at::BFloat16>(), blocks); break;
    case torch::kHalf: run_blocks(xp, xs, M, K, N, wp, bp, y.data_ptr<at::Half>(), blocks); break;
    default: TORCH_CHECK(false, "linear_bf16: x must be fp32, bf16 or fp16");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("pack_bf16(Tensor weight) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("pack_bf16", &pack_bf16);
  m.impl("linear_bf16", &linear_bf16);
}
