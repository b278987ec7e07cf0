// The small operations of a Llama decoder layer, fused, fp32 on the CPU: RMSNorm (with the
// residual add before it), rotary embedding applied in place, and SiLU(gate) * up.
//
// In eager PyTorch each of these is 3-7 operator calls, ~1200 per SmolLM2 step; with the linear
// layers fast, their dispatch and Python were ~40 % of a one-row decode step (engine/fused_llama.py
// uses these instead). The math follows transformers' Llama modules: the same formulas in fp32,
// differing from them only in summation order and rounding (last bits).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.dim() == 2 && t.stride(1) == 1,
              name, ": must be a [N, C] fp32 CPU tensor, unit stride over C");
}

inline int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols)); }

// out = weight * x / sqrt(mean(x^2) + eps), row by row.
inline void norm_row(const float* x, const float* w, float* out, int64_t C, double eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < C; ++c) sum += x[c] * x[c];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(C) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) out[c] = w[c] * (x[c] * inv);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight must be [C]");
  const int64_t N = x.size(0), C = x.size(1);
  auto out = torch::empty({N, C}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * x.stride(0), wp, op + r * C, C, eps);
  });
  return out;
}

// residual += x (in place), then returns rms_norm(residual).
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor residual, const torch::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm: x");
  check_rows(residual, "add_rms_norm: residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous(), "add_rms_norm: residual must be x's shape, contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: weight must be [C]");
  const int64_t N = x.size(0), C = x.size(1);
  auto out = torch::empty({N, C}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *rp = residual.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* res = rp + r * C;
      const float* xr = xp + r * x.stride(0);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) res[c] = res[c] + xr[c];
      norm_row(res, wp, op + r * C, C, eps);
    }
  });
  return out;
}

// x [N, H, D] in place: x = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (halves of D);
// cos/sin [N, D] per row's position.
void rotate(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [N, H, D] fp32");
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  const int64_t rs = x.stride(0), hs = x.stride(1);
  at::parallel_for(0, N, grain(H * D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *c = cp + r * D, *s = sp + r * D;
      for (int64_t h = 0; h < H; ++h) {
        float* v = xp + r * rs + h * hs;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = v[d], b = v[d + half];
          v[d] = a * c[d] + (-b) * s[d];
          v[d + half] = b * c[d + half] + a * s[d + half];
        }
      }
    }
  });
}

void rotary(torch::Tensor q, torch::Tensor k, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
              cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && q.size(2) % 2 == 0,
              "rotary: cos/sin must be [N, D] fp32, D even");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "rotary: q and k shapes");
  rotate(q, cos, sin);
  rotate(k, cos, sin);
}

// gate_up [N, 2I] (gate then up) -> silu(gate) * up [N, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul: gate_up");
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({N, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = gp + r * gate_up.stride(0), *u = g + I;
      float* o = op + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
