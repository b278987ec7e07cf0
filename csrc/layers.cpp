// The small operations of a Llama decoder layer, fused, on the CPU: RMSNorm (with the residual
// add before it), rotary embedding applied in place, and SiLU(gate) * up.
//
// In eager PyTorch each of these is 3-7 operator calls, ~1200 per SmolLM2 step; with the linear
// layers fast, their dispatch and Python were ~40 % of a one-row decode step (engine/fused_llama.py
// uses these instead). The math follows transformers' Llama modules: the same formulas in fp32,
// differing from them only in summation order and rounding (last bits). For bf16/fp16 tensors
// the math is fp32 too and results are rounded to the storage dtype where transformers' modules
// round them (each eager op's output): the residual sum, the normalized row before the weight
// and the weighted row; each rotary product and their sum; SiLU(gate) and its product with up.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "parallel.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace {

using streamgate::cpu::exp_nonpositive;
using streamgate::cpu::lanes_of;
using streamgate::cpu::load_v;
using streamgate::cpu::store_v;
using streamgate::cpu::vec16;
using streamgate::cpu::vec16i;
using streamgate::cpu::vec8i;
using streamgate::cpu::vec8;

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_floating_point() && t.dim() == 2 && t.stride(1) == 1,
              name, ": must be a [N, C] floating-point CPU tensor, unit stride over C");
}

inline int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols)); }

// fp32 rounded to bf16 precision (to nearest even), kept as fp32: integer ops only, so loops of
// it vectorize (c10's conversion has a NaN branch that keeps GCC from vectorizing them).
inline float round_bf16(float x) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  return std::bit_cast<float>((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

// x rounded to T and back: a no-op for fp32, the rounding of one eager bf16/fp16 op otherwise.
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return round_bf16(x);
  else return static_cast<float>(static_cast<T>(x));
}

// p[i] as fp32, and v stored into p[i] rounded to T: bf16 by bit operations (vectorizable).
template <typename T>
inline float ld(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return std::bit_cast<float>(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
  else return static_cast<float>(p[i]);
}

template <typename T>
inline void st(T* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(round_bf16(v)) >> 16);
  else p[i] = static_cast<T>(v);
}

// out = weight * T(x / sqrt(mean(x^2) + eps)), row by row.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t C, double eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < C; ++c) sum += ld(x, c) * ld(x, c);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(C) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) st(out, c, ld(w, c) * round_to<T>(ld(x, c) * inv));
}

// res += x (rounded to T), then out = norm_row(res).
template <typename T>
inline void add_norm_row(const T* x, T* res, const T* w, T* out, int64_t C, double eps) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) st(res, c, ld(res, c) + ld(x, c));
  norm_row(res, w, out, C, eps);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [C], x's dtype");
  const int64_t N = x.size(0), C = x.size(1);
  auto out = torch::empty({N, C}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    streamgate::cpu::parallel_for(0, N, grain(C), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * x.stride(0), wp, op + r * C, C, eps);
    });
  });
  return out;
}

// residual += x (in place), then returns rms_norm(residual).
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor residual, const torch::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm: x");
  check_rows(residual, "add_rms_norm: residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be x's shape and dtype, contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be [C], x's dtype");
  const int64_t N = x.size(0), C = x.size(1);
  auto out = torch::empty({N, C}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t *rp = residual.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    streamgate::cpu::parallel_for(0, N, grain(C), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) add_norm_row(xp + r * x.stride(0), rp + r * C, wp, op + r * C, C, eps);
    });
  });
  return out;
}

// x [N, H, D] in place: x = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (halves of D);
// cos/sin [N, D] fp32 per row's position (for bf16/fp16 x: the values transformers casts to x's dtype).
template <typename T>
void rotate(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  T* xp = x.data_ptr<T>();
  const int64_t rs = x.stride(0), hs = x.stride(1);
  streamgate::cpu::parallel_for(0, N, grain(H * D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *c = cp + r * D, *s = sp + r * D;
      for (int64_t h = 0; h < H; ++h) {
        T* v = xp + r * rs + h * hs;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = ld(v, d), b = ld(v, d + half);
          st(v, d, round_to<T>(a * c[d]) + round_to<T>((-b) * s[d]));
          st(v, d + half, round_to<T>(b * c[d + half]) + round_to<T>(a * s[d + half]));
        }
      }
    }
  });
}

void rotary(torch::Tensor q, torch::Tensor k, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
              cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && q.size(2) % 2 == 0,
              "rotary: cos/sin must be [N, D] fp32, D even");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.is_floating_point() &&
              k.scalar_type() == q.scalar_type(), "rotary: q, k must be [N, H, D] of one floating dtype");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "rotary: q and k shapes");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    rotate<scalar_t>(q, cos, sin);
    rotate<scalar_t>(k, cos, sin);
  });
}

// A vector V (vec8 or vec16) of T as fp32 (ldv), rounded to T's precision (roundv), stored as T
// (stv): bf16 by whole-vector bit operations, so the loops below stay in registers.
using streamgate::cpu::Bits;

template <typename V, typename T>
inline V ldv(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load_v<V>(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return streamgate::cpu::load_bf16_v<V>(p);
  } else {
    float buf[lanes_of<V>];
    for (int l = 0; l < lanes_of<V>; ++l) buf[l] = static_cast<float>(p[l]);
    return load_v<V>(buf);
  }
}

template <typename T, typename V>
inline V roundv(V x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return streamgate::cpu::round_bf16_v(x);
  } else {
    float buf[lanes_of<V>];
    store_v(buf, x);
    for (int l = 0; l < lanes_of<V>; ++l) buf[l] = round_to<T>(buf[l]);
    return load_v<V>(buf);
  }
}

template <typename T, typename V>
inline void stv(T* p, V x) {
  if constexpr (std::is_same_v<T, float>) {
    store_v(p, x);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const auto h = __builtin_convertvector(std::bit_cast<typename Bits<V>::w>(roundv<T>(x)) >> 16,
                                           typename Bits<V>::h);
    std::memcpy(p, &h, sizeof h);
  } else {
    float buf[lanes_of<V>];
    store_v(buf, x);
    for (int l = 0; l < lanes_of<V>; ++l) p[l] = static_cast<T>(buf[l]);
  }
}

// o[i, i + lanes) = silu(g) * u over whole vectors V from i while they fit; returns where it stopped.
template <typename V, typename VI, typename T>
inline int64_t silu_mul_lanes(const T* g, const T* u, T* o, int64_t i, int64_t I) {
  for (; i + lanes_of<V> <= I; i += lanes_of<V>)
    stv(o + i, streamgate::cpu::silu_mul_core<V, VI>(ldv<V>(g + i), ldv<V>(u + i), [](V s) { return roundv<T>(s); }));
  return i;
}

// o = silu(g) * u for one row, u = g + I (silu rounded to T first). silu(g) = g * sigmoid(g) with
// e = exp(-|g|): sigmoid is 1 / (1 + e) for g >= 0 and e / (1 + e) below, a vector at a time
// (std::exp in the loop did not vectorize): sixteen lanes where the build has AVX-512 (half the
// instructions of eight; 2026-12-02), then eight, then one.
template <typename T>
inline void silu_mul_row(const T* g, T* o, int64_t I) {
  const T* u = g + I;
  int64_t i = 0;
#ifdef __AVX512F__
  i = silu_mul_lanes<vec16, vec16i>(g, u, o, i, I);
#endif
  i = silu_mul_lanes<vec8, vec8i>(g, u, o, i, I);
  for (; i < I; ++i) {
    const float gi = ld(g, i);
    st(o, i, round_to<T>(gi / (1.0f + std::exp(-gi))) * ld(u, i));
  }
}

// gate_up [N, 2I] (gate then up; block > 0: blocks of `block` gate columns then as many up
// columns, as the fused forward packs gate/up for linear_amx.h's fused epilogue) -> silu(gate) * up [N, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up, int64_t block) {
  check_rows(gate_up, "silu_and_mul: gate_up");
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(block >= 0 && (block == 0 || I % block == 0), "silu_and_mul: block must divide the ", I,
              " outputs (0: gate then up)");
  auto out = torch::empty({N, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    streamgate::cpu::parallel_for(0, N, grain(I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (block == 0) silu_mul_row(gp + r * gate_up.stride(0), op + r * I, I);
        else
          for (int64_t j = 0; j < I / block; ++j)
            silu_mul_row(gp + r * gate_up.stride(0) + 2 * block * j, op + r * I + block * j, block);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up, int block=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
