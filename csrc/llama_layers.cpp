// A step's decoder layers of a Llama-shaped model as one operator call: engine/fused_llama.py's
// layer loop for bf16 weights on the block kernel (no oneDNN copy) or int8 weights on theirs
// (steps the int8 kernel takes), and the plain paged attention, calling the same operators in
// the same order through the dispatcher, so the same bits.
//
// Why: from Python each of a step's ~270 operator calls releases the GIL, and the boxed call
// takes it again to drop its arguments' Python references. Served, the event loop holds the GIL
// between them and can be descheduled while it does (two cores shared with a client): py-spy on
// the engine thread at 8 GuideLLM streams (Zen 4 host, 2026-12-05) found 8 % of its samples
// waiting for the GIL inside those calls, and 14 % waiting for a helper's chunk. One call
// releases the GIL once a step and leaves no Python between the layers' operators.
//
// What does not change from step to step (the weights, the KV pools, the shapes) is bound once
// in a LlamaLayers object: passed as lists every step, SmolLM2's ~480 tensors and Nones took
// 64-79 us a call to convert from Python (under the GIL; a loop over a do-nothing operator of the
// same schema), and the loop copied each optional bias and scale out of its c10::List. In one-row
// int8 steps the call is ~40 us shorter (Zen 4 host, 2026-12-07, both operators alternating).
#include <torch/extension.h>
#include <torch/custom_class.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

namespace {

using T = at::Tensor;
using CT = const at::Tensor&;
using OT = const std::optional<at::Tensor>&;
using Optionals = c10::List<std::optional<at::Tensor>>;

template <typename F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

// Per layer six weights (input norm, packed q/k/v, o, post-attention norm, packed gate/up, down:
// norms as the modules hold them, linears from pack_bf16 or pack_int8), four biases and four
// scales (q/k/v, o, gate/up, down: fp32 or none; a linear with scales is int8), two eps and its
// K and V pools; out_features of q/k/v, o, gate/up and down; silu_block 16: gate/up packed
// alternating in blocks of 16 (linear_bf16_silu), 0: gate then up. The pools are written by
// llama_layers although its schema cannot say so (they sit in this object): the fused forward
// runs eagerly only, never under torch.compile's functionalization.
struct LlamaLayers : torch::CustomClassHolder {
  std::vector<at::Tensor> weights, k_pools, v_pools;
  std::vector<std::optional<at::Tensor>> biases, scales;
  std::vector<double> eps;
  std::vector<int64_t> out_features;
  int64_t silu_block, block_size, heads, kv_heads, head_dim;
  double scale;

  LlamaLayers(std::vector<at::Tensor> weights_, Optionals biases_, Optionals scales_, std::vector<double> eps_,
              std::vector<int64_t> out_features_, int64_t silu_block_, std::vector<at::Tensor> k_pools_,
              std::vector<at::Tensor> v_pools_, int64_t block_size_, double scale_, int64_t heads_,
              int64_t kv_heads_, int64_t head_dim_)
      : weights(std::move(weights_)), k_pools(std::move(k_pools_)), v_pools(std::move(v_pools_)),
        biases(biases_.begin(), biases_.end()), scales(scales_.begin(), scales_.end()), eps(std::move(eps_)),
        out_features(std::move(out_features_)), silu_block(silu_block_), block_size(block_size_), heads(heads_),
        kv_heads(kv_heads_), head_dim(head_dim_), scale(scale_) {
    const size_t layers = k_pools.size();
    TORCH_CHECK(layers > 0 && v_pools.size() == layers && weights.size() == 6 * layers && biases.size() == 4 * layers &&
                scales.size() == 4 * layers && eps.size() == 2 * layers && out_features.size() == 4,
                "LlamaLayers: per layer 6 weights, 4 biases, 4 scales, 2 eps and a K and V pool; 4 out_features");
    TORCH_CHECK(out_features[0] == (heads + 2 * kv_heads) * head_dim && out_features[1] == out_features[3],
                "LlamaLayers: out_features do not match the heads");
  }
};

// residual [N, C] (updated in place, as add_rms_norm does); cos/sin [N, head_dim] fp32; the
// step's slots, block tables, query starts and context lengths for write_kv and the attention.
// Returns the last layer's MLP output, before the final norm's residual add.
T llama_layers(const c10::intrusive_ptr<LlamaLayers>& m, T residual, CT cos, CT sin, CT slots, CT block_tables,
               CT q_start, CT ctx_lens) {
  static const auto rms_norm = op<T(CT, CT, double)>("streamgate::rms_norm");
  static const auto add_rms_norm = op<T(CT, T, CT, double)>("streamgate::add_rms_norm");
  static const auto rotary = op<void(T, T, CT, CT)>("streamgate::rotary");
  static const auto silu_and_mul = op<T(CT, int64_t)>("streamgate::silu_and_mul");
  static const auto write_kv = op<void(T, T, CT, CT, CT)>("streamgate::write_kv");
  static const auto linear = op<T(CT, CT, OT, int64_t)>("streamgate::linear_bf16");
  static const auto linear8 = op<T(CT, CT, CT, OT, int64_t)>("streamgate::linear_int8");
  static const auto linear_silu = op<T(CT, CT, OT, int64_t)>("streamgate::linear_bf16_silu");
  static const auto attention = op<void(CT, CT, CT, CT, CT, CT, int64_t, double, T)>("streamgate::paged_attention");
  const int64_t layers = static_cast<int64_t>(m->k_pools.size()), n = residual.size(0);
  const int64_t heads = m->heads, kv_heads = m->kv_heads, head_dim = m->head_dim;
  const auto& out_features = m->out_features;
  TORCH_CHECK(out_features[1] == residual.size(1), "llama_layers: the residual's width is not the model's");
  T x, hidden;
  for (int64_t i = 0; i < layers; ++i) {
    const T* w = m->weights.data() + 6 * i;
    // linear j of the layer (0 q/k/v, 1 o, 2 gate/up, 3 down) on x, on its weight's kernel.
    auto lin = [&](const T& x, int64_t j, const T& weight) {
      const std::optional<at::Tensor>& s = m->scales[4 * i + j];
      return s.has_value() ? linear8.call(x, weight, *s, m->biases[4 * i + j], out_features[j])
                           : linear.call(x, weight, m->biases[4 * i + j], out_features[j]);
    };
    x = i == 0 ? rms_norm.call(residual, w[0], m->eps[0]) : add_rms_norm.call(hidden, residual, w[0], m->eps[2 * i]);
    const T qkv = lin(x, 0, w[1]).view({n, heads + 2 * kv_heads, head_dim});
    const T q = qkv.narrow(1, 0, heads), k = qkv.narrow(1, heads, kv_heads);
    const T v = qkv.narrow(1, heads + kv_heads, kv_heads);
    rotary.call(q, k, cos, sin);
    write_kv.call(m->k_pools[i], m->v_pools[i], slots, k, v);
    T out = at::empty({n, heads, head_dim}, q.options());
    attention.call(q, m->k_pools[i], m->v_pools[i], block_tables, q_start, ctx_lens, m->block_size, m->scale, out);
    x = add_rms_norm.call(lin(out.view({n, heads * head_dim}), 1, w[2]), residual, w[3], m->eps[2 * i + 1]);
    const T act = m->silu_block ? linear_silu.call(x, w[4], m->biases[4 * i + 2], out_features[2])
                                : silu_and_mul.call(lin(x, 2, w[4]), 0);
    hidden = lin(act, 3, w[5]);
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgate, m) {
  m.class_<LlamaLayers>("LlamaLayers")
      .def(torch::init<std::vector<at::Tensor>, Optionals, Optionals, std::vector<double>, std::vector<int64_t>,
                       int64_t, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, double, int64_t, int64_t,
                       int64_t>());
  m.def("llama_layers(__torch__.torch.classes.streamgate.LlamaLayers layers, Tensor(a!) residual, Tensor cos, "
        "Tensor sin, Tensor slots, Tensor block_tables, Tensor q_start, Tensor ctx_lens) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgate, CPU, m) {
  m.impl("llama_layers", &llama_layers);
}
