// bf16-weight linear layers on the CPU for steps of few rows: y = x W^T + b, W bf16.
//
// A decode step is bound by reading the weights; oneDNN's prepacked bf16 matmul reaches only
// ~21 GFLOP/s at one row on the Zen 4 host (AVX512-BF16, no AMX), far below what the bytes
// allow. This kernel streams the weight packed once at load in blocks of 16 outputs, K-major
// (linear_blocks.h), in one of two layouts, chosen by the build variant; pack_bf16 writes the
// one its own library's linear_bf16 reads:
// - with AVX512-BF16 (the avx512_bf16 variant): [ceil(N/16), ceil(K/2), 16, 2], 16 outputs x
//   one k-pair = one 64-byte register. bf16 activations (the fused bf16 forward's) are read
//   as k-pairs as they are and multiplied by VDPBF16PS, which sums two exact bf16 products
//   into each fp32 lane: twice the MACs of an FMA and no widening. fp32 and fp16 activations
//   keep the exact FMA path below on the same layout (their k-even half widened by a shift,
//   the k-odd half by a mask), so no call rounds its activations to bf16. VDPBF16PS treats
//   bf16 subnormals (below 2^-126) as zero and flushes subnormal fp32 results, as oneDNN's
//   bf16 GEMM does on the same instruction.
// - elsewhere: [ceil(N/16), K, 16]; each 32-byte row is widened to fp32 by a 16-bit left
//   shift (exact: bf16 is fp32's upper half) and FMA'd with the activation, broadcast.
// Accumulation is fp32 either way; the bias is added once at the end and the output rounded
// once to the activation's dtype. Blocks are split over the threads.
//
// The VDPBF16PS form runs 8 rows a pass, one in-order sum per output at every pass width
// (row-invariant: a row gets the same bits whatever rows share the call), prefetches the
// weight stream by pass width and CPU (linear_dp.h's pass_ahead: off Intel, passes of 4+ rows
// into L2 16 KB ahead), and takes each thread's blocks in ~256 KB groups, every pass over a
// group before the next, so a pass's activations stay in L1 and the weights are read from
// memory once a call. Measured on the Zen 4 host (shared, load 4-5, one thread; 2026-12-02; python -m
// bench.engine.gemm --crossover --threads 1) against oneDNN's prepacked bf16 matmul at
// SmolLM2-135M's shapes: 1.75-2.5x at 1 row, 1.2-1.7x at 8, 1.0-1.2x at 32, 0.96-1.05x at
// 64-512 (~190 GFLOP/s a core, as oneDNN); the head 1.8-2.1x at 1-2 rows, 0.87-1.1x at
// 4-512. The shift+FMA form runs linear_blocks.h's register tiles (8 rows x 3 blocks a pass),
// compute-bound from ~8 rows: on the Intel Ice Lake host ~150-210 of two cores' ~330 fp32 GFLOP/s.
#include "parallel.h"
#include "linear_blocks.h"
#include "linear_amx.h"
#include "linear_dp.h"

namespace {

using namespace streamgate_linear;

#if defined(__AVX512BF16__)
constexpr int kPack = 2;         // k per packed row: a VDPBF16PS pair
// Word i of a packed row of 16 k-pairs from [16 values of k | 16 of k + 1]: n's two adjacent.
alignas(64) constexpr uint16_t kPairOrder[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
#else
constexpr int kPack = 1;
#endif

// bf16 codes widened to fp32 lanes for the FMA path (exact).
struct Bf16Code {
  using code_t = uint16_t;
  static constexpr int kPack = ::kPack;
  static inline lanes_t widen(const uint16_t* row, int s, int p) {
#if defined(__AVX512BF16__)
    (void)p;                                       // one register per packed row
    const __m512i v = _mm512_loadu_si512(row);
    const __m512i w = s == 0 ? _mm512_slli_epi32(v, 16) : _mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u)));
    return reinterpret_cast<lanes_t>(_mm512_castsi512_ps(w));
#else
    (void)s;
    const uint16_t* q = row + p * kLanes;
#if defined(__AVX512F__)
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    return reinterpret_cast<lanes_t>(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
#elif defined(__AVX2__)
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return reinterpret_cast<lanes_t>(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
#else
    typedef uint16_t halves_t __attribute__((vector_size(16)));
    typedef uint32_t bits_t __attribute__((vector_size(32)));
    halves_t h;
    std::memcpy(&h, q, sizeof h);
    const bits_t bits = __builtin_convertvector(h, bits_t) << 16;
    lanes_t v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
#endif
#endif
  }
};


// weight [N, K] bf16 -> packed [ceil(N/16), K, 16] (or [ceil(N/16), ceil(K/2), 16, 2] with
// AVX512-BF16) bf16, zero past N and K.
torch::Tensor pack_bf16(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kBFloat16 && weight.dim() == 2,
              "pack_bf16: weight must be a 2-d bf16 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kBlock - 1) / kBlock;
  const int64_t rows = (K + kPack - 1) / kPack;
  auto packed = kPack == 1 ? torch::zeros({blocks, K, kBlock}, weight.options())
                           : torch::zeros({blocks, rows, kBlock, kPack}, weight.options());
  const auto c = weight.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(c.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t n = b * kBlock; n < std::min(N, (b + 1) * kBlock); ++n)
        for (int64_t k = 0; k < K; ++k)
          dst[((b * rows + k / kPack) * kBlock + n % kBlock) * kPack + k % kPack] = src[n * K + k];
  });
  return packed;
}

// K of a packed weight, checked against x's.
void check_packed(const torch::Tensor& packed, int64_t N, int64_t K, const char* op) {
  const bool shape = kPack == 1 ? packed.dim() == 3 && packed.size(1) == K && packed.size(2) == kBlock
                                : packed.dim() == 4 && packed.size(1) == (K + 1) / 2 && packed.size(2) == kBlock &&
                                      packed.size(3) == kPack;
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
              packed.dim() >= 3 && packed.size(0) == (N + kBlock - 1) / kBlock,
              op, ": packed weight must come from this library's pack_bf16 for ", N, " outputs");
  TORCH_CHECK(shape, op, ": packed weight does not match x's K (", K, ")");
}

template <typename T>
void run(const torch::Tensor& x, const torch::Tensor& packed, const float* bp, int64_t N, torch::Tensor& y) {
  const Out<T> out{y.data_ptr<T>(), N, nullptr, bp};
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const auto xp = bf16_pairs(x);
    dp_blocks(reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()), xp.stride(0) / 2, M, packed.size(1), N,
              wp, out, blocks);
    return;
  }
#endif
  const auto xf = fp32_rows(x);
  fma_blocks<Bf16Code, kNoPrefetch>(xf.data_ptr<float>(), xf.stride(0), M, K, N, wp, out, blocks, 32 << 10);
}

// Rows above which bf16 steps run on AMX tiles where they may (linear_amx.h, reading the
// pair-packed blocks in place): up to here the VDPBF16PS passes keep their row-invariant sums
// (decode, one sequence's speculative verification).
constexpr int64_t kAmxMinRows = 4;

// x [M, K] fp32, bf16 or fp16 (any strides); packed from pack_bf16; bias [N] fp32 or none
// -> y [M, N] in x's dtype, rounded once from the fp32 sum.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "linear_bf16: x must be [M, K] on the CPU");
  const int64_t N = out_features;
  check_packed(packed, N, x.size(1), "linear_bf16");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                                    bias->numel() == N), "linear_bf16: bias must be [out_features] fp32");
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (kPack == 2 && streamgate::cpu::amx_linear_rows(x, kAmxMinRows)) {
    const int64_t K = x.size(1);
    const auto* words = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
    return streamgate::cpu::on_row_tiles(x, N, [&](const streamgate::cpu::RowTiles& xp, int64_t M, int64_t M16, c10::BFloat16* y) {
      streamgate::cpu::linear_bf16_amx(xp, M, M16, K, words, packed.size(0), N, bp, y);
    });
  }
  auto y = torch::empty({x.size(0), N}, x.options());
  switch (x.scalar_type()) {
    case torch::kFloat: run<float>(x, packed, bp, N, y); break;
    case torch::kBFloat16: run<at::BFloat16>(x, packed, bp, N, y); break;
    case torch::kHalf: run<at::Half>(x, packed, bp, N, y); break;
    default: TORCH_CHECK(false, "linear_bf16: x must be fp32, bf16 or fp16");
  }
  return y;
}

// linear_bf16 and silu_and_mul(block=16) in one pass: x [M, K] bf16, packed from pack_bf16 of a
// gate/up weight whose 16-output blocks alternate gate and up (out_features % 32 == 0) -> y
// [M, out_features / 2] = silu(gate) * up, the same bits. On AMX tiles where linear_bf16 takes
// them, else VDPBF16PS passes (the avx512_bf16 build); other builds refuse it.
torch::Tensor linear_bf16_silu(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                               int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "linear_bf16_silu: x must be [M, K] on the CPU");
  const int64_t N = out_features;
  check_packed(packed, N, x.size(1), "linear_bf16_silu");
  TORCH_CHECK(N % 32 == 0, "linear_bf16_silu: out_features must be a multiple of 32 (gate/up blocks of 16)");
  TORCH_CHECK(kPack == 2 && x.scalar_type() == torch::kBFloat16,
              "linear_bf16_silu: runs on bf16 rows in the avx512_bf16 build only (VDPBF16PS or AMX)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                                    bias->numel() == N), "linear_bf16_silu: bias must be [out_features] fp32");
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t K = x.size(1);
  if (streamgate::cpu::amx_linear_rows(x, kAmxMinRows)) {
    const auto* words = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
    return streamgate::cpu::on_row_tiles(x, N / 2, [&](const streamgate::cpu::RowTiles& xp, int64_t M, int64_t M16, c10::BFloat16* y) {
      streamgate::cpu::linear_bf16_amx_silu(xp, M, M16, K, words, packed.size(0), N, bp, y);
    });
  }
  auto y = torch::empty({x.size(0), N / 2}, x.options());
#if defined(__AVX512BF16__)
  const auto xp = bf16_pairs(x);
  dp_blocks_silu(reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()), xp.stride(0) / 2, x.size(0),
                 packed.size(1), N, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                 Out<c10::BFloat16>{y.data_ptr<c10::BFloat16>(), N / 2, nullptr, bp});
#endif
  return y;
}

// pack_int8's codes [ceil(N/16), K, 16] and their per-output scales -> q * s rounded to bf16
// (to nearest even, as dequantize_int8 rounds it) in pack_bf16's layout, into `out` (pack_bf16's
// shape for N x K): int8 prefill steps dequantize a layer this way into a reused buffer and run
// linear_bf16 on it (engine/quantization.py), not oneDNN on a plain transposed copy.
void dequantize_int8_bf16(const torch::Tensor& codes, const torch::Tensor& scales, torch::Tensor out) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == torch::kChar && codes.dim() == 3 &&
              codes.size(2) == kBlock && codes.is_contiguous(), "dequantize_int8_bf16: codes must come from pack_int8");
  const int64_t blocks = codes.size(0), K = codes.size(1), N = scales.numel();
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && (N + kBlock - 1) / kBlock == blocks,
              "dequantize_int8_bf16: scales must be [out_features] fp32, one per output of the codes' blocks");
  check_packed(out, N, K, "dequantize_int8_bf16");
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t rows = (K + kPack - 1) / kPack;
  streamgate::cpu::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float s[kBlock] = {};                        // 0 past N: those outputs' weights are 0
      std::memcpy(s, sp + b * kBlock, std::min(kBlock, N - b * kBlock) * sizeof(float));
      const int8_t* src = cp + b * K * kBlock;
      uint16_t* dst = op + b * rows * kBlock * kPack;
      int64_t k = 0;
#if defined(__AVX512BF16__)
      // A k-pair: two rows of 16 codes widened and scaled, rounded to bf16 together, the pairs
      // interleaved (output n's k and k + 1 adjacent) by one word permute.
      const __m512i pairs = _mm512_loadu_si512(kPairOrder);
      const __m512 sv = _mm512_loadu_ps(s);
      auto row = [&](int64_t r) {
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                 reinterpret_cast<const __m128i*>(src + r * kBlock)))), sv);
      };
      for (; k + 2 <= K; k += 2) {
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(row(k + 1), row(k)));
        _mm512_storeu_si512(dst + k / 2 * kBlock * 2, _mm512_permutexvar_epi16(pairs, both));
      }
#endif
      for (; k < K; ++k)
        for (int64_t n = 0; n < kBlock; ++n)
          dst[(k / kPack * kBlock + n) * kPack + k % kPack] = c10::BFloat16(src[k * kBlock + n] * s[n]).x;
      if (kPack == 2 && K % 2)                     // the last pair's second half
        for (int64_t n = 0; n < kBlock; ++n) dst[((K / 2) * kBlock + n) * 2 + 1] = 0;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("linear_bf16_silu(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("pack_bf16(Tensor weight) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("dequantize_int8_bf16(Tensor codes, Tensor scales, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("pack_bf16", &pack_bf16);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_bf16_silu", &linear_bf16_silu);
  m.impl("dequantize_int8_bf16", &dequantize_int8_bf16);
}
