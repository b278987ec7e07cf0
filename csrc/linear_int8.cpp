// int8 weight-only linear layers on the CPU: y = (x q^T) * s + b, with q int8 codes and s one
// fp32 scale per output channel (engine/quantization.py quantizes).
//
// A step of few rows (decode, speculative verification) is bound by reading the weights, and
// int8 codes are half of bf16's bytes. The codes are packed as linear.cpp packs fp32 weights,
// [ceil(N/16), K, 16]: block j holds outputs 16j..16j+15, K-major, one contiguous stream of
// 16-byte rows. linear_blocks.h's FMA path (shared with linear_bf16.cpp) widens each row to
// sixteen fp32 lanes in registers (sign-extend + convert: one AVX-512 register, two AVX2 ones,
// two vector-extension ones elsewhere) and FMAs it with the activation, broadcast;
// accumulation is fp32, the scale and bias are applied once at the end and the result
// rounded once to the activation's dtype. A pass widens each row of several blocks side by side
// once for up to 8 rows (linear_blocks.h's tiles); blocks are split over the threads, with a
// software prefetch 4 KB ahead (prefetchnta, or prefetcht0 on Intel's CPUs: linear_blocks.h).
// Activations in bf16/fp16 are converted to fp32 once per call (a few rows).
//
// dequantize_int8 writes q * s in the model's dtype as a plain transposed weight [K, N]: steps
// of many rows (a prefill chunk) dequantize one layer into a reused scratch buffer and run
// the dtype's GEMM, so no dequantized copy is kept.
#include "parallel.h"
#include "linear_blocks.h"
#include "linear_amx.h"
#include "linear_vnni.h"

#include <atomic>
#include <optional>

namespace {

using namespace streamgate_linear;

// codes p[part * kLanes ...] -> fp32 lanes (sign-extend, convert). A generic int8 -> float
// __builtin_convertvector is scalarized by GCC, so x86 gets the instructions by name.
inline lanes_t widen(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<lanes_t>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<lanes_t>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  typedef int8_t bytes_t __attribute__((vector_size(8)));
  typedef int32_t ints_t __attribute__((vector_size(32)));
  bytes_t b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, ints_t), lanes_t);
#endif
}

// int8 codes for linear_blocks.h's FMA path: one k per packed row of 16 bytes.
struct Int8Code {
  using code_t = int8_t;
  static constexpr int kPack = 1;
  static inline lanes_t widen(const int8_t* row, int, int p) { return ::widen(row + p * kLanes); }
};

// codes [N, K] int8 -> packed [ceil(N/16), K, 16] int8, zero past N.
torch::Tensor pack_int8(const torch::Tensor& codes) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == torch::kChar && codes.dim() == 2,
              "pack_int8: codes must be a 2-d int8 CPU tensor");
  const int64_t N = codes.size(0), K = codes.size(1), blocks = (N + kBlock - 1) / kBlock;
  auto packed = torch::zeros({blocks, K, kBlock}, codes.options());
  const auto c = codes.contiguous();
  const int8_t* src = c.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t n = b * kBlock; n < std::min(N, (b + 1) * kBlock); ++n)
        for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * kBlock + n % kBlock] = src[n * K + k];
  });
  return packed;
}

void check_packed(const torch::Tensor& packed, const torch::Tensor& scales, int64_t N, const char* op) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kChar && packed.dim() == 3 &&
              packed.size(2) == kBlock && packed.is_contiguous() && packed.size(0) == (N + kBlock - 1) / kBlock,
              op, ": packed codes must be [ceil(N/16), K, 16] int8 from pack_int8");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == N,
              op, ": scales must be [out_features] fp32");
}

// Rows above which a bf16 step runs on AMX tiles where it may (linear_amx.h). Whole SmolLM2
// decode steps, Intel AMX host, 2 threads: 19.6-19.7 ms on the FMA path against 20.4-20.7 on
// tiles at 8 rows, 32.4-34.2 against 25.4-25.8 at 16, 60.5 against 38.0-38.2 at 32 (the 120
// layer linears alone, weights in cache: 7.3 against 6.3 ms at 8 rows, 26.4 against 7.5 at 32;
// widening the codes, ~6 ms, is the tiles' floor). Steps of up to eight rows (decode, one
// sequence's speculative verification) keep the FMA path's sums.
constexpr int64_t kAmxMinRows = 8;
// ... and where bf16/fp16 rows take VNNI (linear_vnni.h) instead of the FMA path: SmolLM2's 120
// layer linears (weights from memory, 2 threads, Intel AMX host, 2026-12-05) took 7.7 ms on VNNI
// against 11.5 on the FMA path at 8 rows, 10.0 against 12.7 on tiles at 12, 13.6 against 12.0 at
// 16: steps of up to twelve rows keep VNNI's sums (row-invariant too).
constexpr int64_t kVnniMaxRows = 12;

// linear_int8 on AMX tiles (linear_amx.h).
torch::Tensor linear_amx(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                         const c10::optional<torch::Tensor>& bias, int64_t N) {
  const int64_t K = x.size(1);
  return streamgate::cpu::on_row_tiles(x, N, [&](const streamgate::cpu::RowTiles& xp, int64_t M, int64_t M16, c10::BFloat16* y) {
    streamgate::cpu::linear_int8_amx(xp, M, M16, K, packed.data_ptr<int8_t>(), packed.size(0), N,
                                     scales.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr, y);
  });
}

// Whether bf16/fp16 steps that do not take the AMX tiles run on VNNI (linear_vnni.h): on where
// the build has it; int8_vnni(false) sends them to the FMA path (benchmarks, tests).
std::atomic<bool>& vnni_switch() {
  static std::atomic<bool> on{kVnniBuilt};
  return on;
}

bool int8_vnni(std::optional<bool> enable) {
  if (enable.has_value()) vnni_switch().store(*enable && kVnniBuilt);
  return vnni_switch().load();
}

// linear_int8 on VNNI (linear_vnni.h): x bf16 or fp16, unit stride over K, K % 4 == 0.
template <int H>
torch::Tensor linear_vnni(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias, int64_t N) {
  torch::Tensor y = torch::empty({x.size(0), N}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  {
    const int64_t M = x.size(0), K = x.size(1);
    const float* sp = scales.data_ptr<float>();
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    thread_local SplitRows rows;
    if (x.scalar_type() == torch::kBFloat16) {
      split_rows(x.data_ptr<at::BFloat16>(), x.stride(0), M, K, rows);
      vnni_blocks<H>(rows, M, K, N, packed.data_ptr<int8_t>(), Out<at::BFloat16>{y.data_ptr<at::BFloat16>(), N, sp, bp},
                     packed.size(0), 32 << 10);
    } else {
      split_rows(x.data_ptr<at::Half>(), x.stride(0), M, K, rows);
      vnni_blocks<H>(rows, M, K, N, packed.data_ptr<int8_t>(), Out<at::Half>{y.data_ptr<at::Half>(), N, sp, bp},
                     packed.size(0), 32 << 10);
    }
  }
#endif
  return y;
}

// x [M, K] fp32, bf16 or fp16; packed from pack_int8; scales [N] fp32; bias [N] fp32 or none
// -> y [M, N] in x's dtype.
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "linear_int8: x must be [M, K] on the CPU");
  const int64_t N = out_features;
  check_packed(packed, scales, N, "linear_int8");
  TORCH_CHECK(packed.size(1) == x.size(1), "linear_int8: packed codes do not match x's K");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                                    bias->numel() == N), "linear_int8: bias must be [out_features] fp32");
  const bool vnni = x.scalar_type() != torch::kFloat && x.stride(1) == 1 && x.size(1) % 4 == 0 &&
                    vnni_switch().load(std::memory_order_relaxed);
  if (streamgate::cpu::amx_linear_rows(x, vnni ? kVnniMaxRows : kAmxMinRows)) return linear_amx(x, packed, scales, bias, N);
  if (vnni)
    return stream_prefetch_hint() == kPrefetchT0 ? linear_vnni<kPrefetchT0>(x, packed, scales, bias, N)
                                                 : linear_vnni<kPrefetchNta>(x, packed, scales, bias, N);
  const auto xf = fp32_rows(x);
  const int64_t M = xf.size(0), K = xf.size(1), blocks = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // Software prefetch 4 KB ahead in the stream, with the locality this CPU measured best at
  // (linear_blocks.h's stream_prefetch_hint).
  auto run = [&](auto hint) {
    constexpr int H = decltype(hint)::value;
    switch (x.scalar_type()) {
      case torch::kFloat:
        fma_blocks<Int8Code, H>(xf.data_ptr<float>(), xf.stride(0), M, K, N, wp, Out<float>{y.data_ptr<float>(), N, sp, bp},
                                blocks, 32 << 10);
        break;
      case torch::kBFloat16:
        fma_blocks<Int8Code, H>(xf.data_ptr<float>(), xf.stride(0), M, K, N, wp,
                                Out<at::BFloat16>{y.data_ptr<at::BFloat16>(), N, sp, bp}, blocks, 32 << 10);
        break;
      case torch::kHalf:
        fma_blocks<Int8Code, H>(xf.data_ptr<float>(), xf.stride(0), M, K, N, wp, Out<at::Half>{y.data_ptr<at::Half>(), N, sp, bp},
                                blocks, 32 << 10);
        break;
      default: TORCH_CHECK(false, "linear_int8: x must be fp32, bf16 or fp16");
    }
  };
  if (stream_prefetch_hint() == kPrefetchT0) run(std::integral_constant<int, kPrefetchT0>{});
  else run(std::integral_constant<int, kPrefetchNta>{});
  return y;
}

// Scaled fp32 lanes -> dst in T: bf16 rounded to nearest even as vectors (q * s is finite),
// fp32 copied, fp16 through c10's scalar conversion.
template <typename T>
inline void store_lanes(lanes_t v, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, &v, sizeof v);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    typedef uint32_t bits_t __attribute__((vector_size(sizeof(lanes_t))));
    typedef uint16_t half_t __attribute__((vector_size(sizeof(lanes_t) / 2)));
    bits_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    const half_t rounded = __builtin_convertvector((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, half_t);
    std::memcpy(dst, &rounded, sizeof rounded);
  } else {
    float f[kLanes];
    std::memcpy(f, &v, sizeof f);
    for (int i = 0; i < kLanes; ++i) dst[i] = static_cast<T>(f[i]);
  }
}

// out[k, n] = packed code (n, k) * scales[n], rounded once to out's dtype: the transposed
// weight [K, N], so each packed row of 16 codes is widened, scaled, rounded and stored as 16
// contiguous outputs (no transpose); y = x @ out is the dtype's plain GEMM.
template <typename T>
void dequantize_blocks(const int8_t* wp, const float* sp, T* op, int64_t N, int64_t K, int64_t blocks) {
  streamgate::cpu::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* block = wp + b * K * kBlock;
      const int64_t n0 = b * kBlock, valid = std::min(kBlock, N - n0);
      float sv[kBlock] = {};
      std::memcpy(sv, sp + n0, valid * sizeof(float));
      lanes_t s[kParts];
      std::memcpy(s, sv, sizeof s);
      T tail[kBlock];
      for (int64_t k = 0; k < K; ++k) {
        T* dst = valid == kBlock ? op + k * N + n0 : tail;
        for (int p = 0; p < kParts; ++p) store_lanes(widen(block + k * kBlock + p * kLanes) * s[p], dst + p * kLanes);
        if (valid < kBlock) std::memcpy(op + k * N + n0, tail, valid * sizeof(T));
      }
    }
  });
}

// packed codes and scales -> out [K, N] (the weight transposed; fp32, bf16 or fp16,
// contiguous), written in place.
void dequantize_int8(const torch::Tensor& packed, const torch::Tensor& scales, torch::Tensor out) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.is_contiguous(), "dequantize_int8: out must be [K, N], contiguous");
  const int64_t K = out.size(0), N = out.size(1);
  check_packed(packed, scales, N, "dequantize_int8");
  TORCH_CHECK(packed.size(1) == K, "dequantize_int8: packed codes do not match out's K");
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  switch (out.scalar_type()) {
    case torch::kFloat: dequantize_blocks(wp, sp, out.data_ptr<float>(), N, K, packed.size(0)); break;
    case torch::kBFloat16: dequantize_blocks(wp, sp, out.data_ptr<at::BFloat16>(), N, K, packed.size(0)); break;
    case torch::kHalf: dequantize_blocks(wp, sp, out.data_ptr<at::Half>(), N, K, packed.size(0)); break;
    default: TORCH_CHECK(false, "dequantize_int8: out must be fp32, bf16 or fp16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("pack_int8(Tensor codes) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("dequantize_int8(Tensor packed, Tensor scales, Tensor(a!) out) -> ()");
  m.def("int8_vnni(bool? enable=None) -> bool", &int8_vnni);
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("pack_int8", &pack_int8);
  m.impl("linear_int8", &linear_int8);
  m.impl("dequantize_int8", &dequantize_int8);
}
