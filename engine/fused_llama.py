"""A lean forward for Llama-shaped models (Llama/SmolLM2, Mistral, Qwen2, Qwen3), eager fp32 or
bf16 on CPU.

transformers' Llama forward runs ~50 operators and a dozen module calls per layer; once the
linear layers were fast (csrc/linear.cpp), that dispatch and Python took ~40 % of a one-row
SmolLM2 decode step. This forward runs the same model on the same weights with ~12 calls per
layer: q/k/v as one packed GEMM and gate/up as another (vLLM's QKV and merged gate-up
layers), and the C++ operators of csrc/layers.cpp for the residual add + RMSNorm, the
rotary embedding (in place) and SiLU(gate) * up. Attention and the KV cache are the engine's
own (attention.py), as on the transformers path. Rotary cos/sin come from the model's own
rotary module (so every rope scaling transformers knows is honoured): once into a table where
the rope type depends on the position alone (`_cos_sin`), else once per step.

Used where `supports()` holds: a family the description marks fused (families.py: Llama,
Mistral, Qwen2, Qwen3: pre-norm RMSNorm layers, SiLU gate/up MLP, full rotary; Qwen2's q/k/v
biases ride in the packed GEMM, Qwen3's per-head q/k RMSNorms run as transformers' modules,
Mistral's sliding window is the attention's), every layer that family's decoder layer, the
C++ kernels built; anything else keeps transformers' forward. fp32 weights are packed for the C++
linear kernel, bf16 ones for the bf16 block kernel and, where it keeps one, oneDNN's matmul
(packed_linear.Bf16Weight); the C++ operators round bf16 results where transformers' bf16
modules do. Greedy parity with HF `generate` is tested as for the transformers path.

Where no bf16 linear keeps a oneDNN copy (every step without bf16 dot products) or int8
runs on its kernel (up to 32 rows), and every layer is plain, the whole layer loop is one
operator call (csrc/llama_layers.cpp: the same operators in the same order, the same bits,
tests/test_llama_layers.py): no Python between them, and the GIL released once a step
instead of at every call, where a served engine waited for it behind the event loop.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from torch import nn

from .attention import kernel_layers, paged_attention
from .fused_pack import fuse, packed_of, silu_block, weight_of
from .kernels import loaded_variant
from .packed_linear import (BF16_BLOCK_COPY_MAX_BYTES, BF16_WIDE_MIN_ROWS, PackedLinear, arrange, available,
                            bf16_kernel_only, bf16_wide_gemm, bf16_widened)
from .quantization import KERNEL_MAX_ROWS as INT8_KERNEL_MAX_ROWS
from .quantization import Int8Weight

log = logging.getLogger("streamgate.engine")


# Rope types whose cos/sin depend on the position alone (transformers' dynamic and longrope
# scaling also look at the sequence's length): FusedLlama keeps them as a table.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")

# model_type -> the transformers class prefix of its CausalLM and decoder layer.
_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def _config_allows(config) -> bool:       # eager, one process, fused_layers and packed_linear not False
    return not (config.fused_layers is False or config.packed_linear is False or config.compile
                or config.tensor_parallel_size > 1)


def _model_config_fits(cfg, family=None) -> bool:     # supports()'s checks on transformers' config alone
    return (getattr(cfg, "model_type", None) in _CLASSES and (family is None or family.fused)
            and getattr(cfg, "hidden_act", None) == "silu" and getattr(cfg, "pretraining_tp", 1) == 1)


def supports(model: nn.Module, family=None) -> bool:
    cfg = model.config
    prefix = _CLASSES.get(getattr(cfg, "model_type", None))
    return (prefix is not None and _model_config_fits(cfg, family) and type(model).__name__ == f"{prefix}ForCausalLM"
            and len(model.model.layers) > 0
            and all(type(m).__name__ == f"{prefix}DecoderLayer" for m in model.model.layers))


def maybe_fuse(model: nn.Module, config, device: torch.device, dtype: torch.dtype,
               family=None) -> FusedLlama | None:
    """The fused forward for eager fp32 or bf16 on CPU in one process, unless `config.fused_layers`
    or `config.packed_linear` is False; None where it does not apply."""
    if not _config_allows(config):
        return None
    kind = "int8" if getattr(config, "quantization", None) == "int8" else linear_kind(dtype)
    if not (device.type == "cpu" and kind and available() == "streamgate" and supports(model, family)):
        return None
    if kind == "onednn" and (bf16_kernel_only() or bf16_widened() or bf16_block_copy_fits(model)):
        kind = "bf16"           # the block kernel alone or widened, or for few rows beside oneDNN (Bf16Weight)
    return FusedLlama(model, kind, family, huge_pages=config.huge_pages)


def bf16_block_copy_fits(model: nn.Module) -> bool:
    """Whether the bf16 block kernel's second copy of the linear weights fits its budget
    (packed_linear.BF16_BLOCK_COPY_MAX_BYTES), where oneDNN's copy is kept beside it (not
    bf16_kernel_only()): a small model gains ~1.4x in one-row decode for its bytes; a large
    one keeps oneDNN's single copy rather than doubling its weights."""
    extra = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear))
    return extra <= BF16_BLOCK_COPY_MAX_BYTES


def bf16_widened_here(config, hf_config) -> bool:
    """Whether this engine config and model (transformers' config) would run bf16 on the fused
    forward on the shift+FMA block kernel (packed_linear.bf16_widened: a CPU without bf16 dot
    products, the weights widened in registers): there `--dtype auto` takes bf16 (dtypes.resolve_dtype)."""
    from .models import check_supported

    return (config.device == "cpu" and bf16_widened() and linear_kind(torch.bfloat16) is not None
            and available() == "streamgate" and _config_allows(config)
            and _model_config_fits(hf_config) and check_supported(hf_config).fused)


def linear_kind(dtype: torch.dtype) -> str | None:
    """How the fused forward packs weights of `dtype`: the C++ kernel (fp32), oneDNN (bf16, where
    oneDNN runs bf16: AVX-512 or better; maybe_fuse then takes the block kernel where it can), the
    block kernel (bf16 on AVX2-only CPUs, the avx2 build: oneDNN has no bf16 there, the kernel's
    AVX2 tiles widen it, MKL's fp32 GEMM takes its big steps: packed_linear.bf16_wide_gemm), or
    None (not fused). SmolLM2 bf16 against fp32 in the avx2 build, played on the Intel Ice Lake
    host (bench.engine.hosts' avx2 flags, MKL at AVX2, 2 threads, 2026-12-07): decode 1 / 8 / 32
    rows 13.3-16.6 / 37.0-42.8 / 112-120 against 28.0-30.2 / 49.6-55.3 / 117-154 ms, a 300-token
    prefill 501-521 against 486-498 ms; transformers' bf16 forward took 40.6-42.3 / 121-143 /
    373-668 and 2,759-3,083."""
    if dtype == torch.float32:
        return "streamgate"
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "onednn"
    if dtype == torch.bfloat16 and bf16_widened() and loaded_variant() == "avx2":
        return "bf16"
    return None


class _Layer:
    """One decoder layer's weights, packed. The transformers modules give theirs up (no second
    copy in memory): the fused ones take their place as `qkv_proj` / `gate_up_proj`, o_proj and
    down_proj become packed, so transformers' own forward cannot run this model any more."""

    def __init__(self, layer: nn.Module, kind: str, window: int | None = None):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn                                        # layer_idx, scaling for attention
        self.window = window
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)   # Qwen3
        self.qkv = attn.qkv_proj = fuse(kind, attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = attn.o_proj = PackedLinear(attn.o_proj, kind)
        self.silu_block = silu_block(kind, mlp)
        self.gate_up = mlp.gate_up_proj = fuse(kind, mlp.gate_proj, mlp.up_proj, block=self.silu_block)
        self.down = mlp.down_proj = PackedLinear(mlp.down_proj, kind)
        attn.q_proj = attn.k_proj = attn.v_proj = mlp.gate_proj = mlp.up_proj = None
        # What each call runs, without nn.Module's call machinery (~120 calls a step).
        self.qkv_w, self.o_w, self.gate_up_w, self.down_w = (
            weight_of(m) for m in (self.qkv, self.o, self.gate_up, self.down))
        self.norm_in, self.eps_in = layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
        self.norm_post = layer.post_attention_layernorm.weight.detach()
        self.eps_post = layer.post_attention_layernorm.variance_epsilon


class FusedLlama:
    """Callable like the transformers model as the runner calls it; returns `.logits` [1, K, V]."""

    def __init__(self, model: nn.Module, kind: str = "streamgate", family=None, huge_pages: bool = False):
        cfg, body = model.config, model.model
        self.kind = kind                                # how the linears are packed (packed_linear.py)
        windows = [layer.window for layer in family.layers] if family is not None else [None] * len(body.layers)
        self.embed, self.rotary_emb = body.embed_tokens.weight.detach(), body.rotary_emb   # rows gathered directly
        # cos/sin rows by position, computed once by the model's rotary module where they depend
        # on the position alone (not dynamic or longrope scaling, which look at the length)
        static = getattr(self.rotary_emb, "rope_type", None) in STATIC_ROPE
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = (torch.empty(0), torch.empty(0)) if static else None
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.qkv_heads = [self.heads, self.kv_heads, self.kv_heads]
        self.layers = [_Layer(layer, kind, w) for layer, w in zip(body.layers, windows)]
        self.norm, self.eps = body.norm.weight.detach(), body.norm.variance_epsilon
        self.lm_head = model.lm_head = PackedLinear(model.lm_head, kind)   # a tied one: its own copy
        if huge_pages:                  # in the order a step reads them (huge_pages.py)
            arrange([m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head])
        self.layer_args = self._cpp_layer_args()
        self.cpp_layers = self.layer_args is not None     # tests and benchmarks turn it off to compare
        # Bigger steps take the Python loop: int8's dequantizing GEMM (quantization.py), bf16's widened one (avx2).
        self.cpp_max_rows = (INT8_KERNEL_MAX_ROWS if kind == "int8"
                             else BF16_WIDE_MIN_ROWS - 1 if bf16_wide_gemm() else float("inf"))
        self._bound: tuple | None = None                  # (the pools, their LlamaLayers): _bound_layers
        log.info("fused Llama-shaped forward (%s): %d layers, q/k/v and gate/up packed as one GEMM each (%s)",
                 cfg.model_type, len(self.layers), kind)

    def _cpp_layer_args(self) -> tuple | None:
        """The weights, biases, scales, eps and shapes csrc/llama_layers.cpp takes, where it can
        run every layer: bf16 weights on the block kernel alone (no oneDNN copy) or int8 ones on
        theirs (steps of up to KERNEL_MAX_ROWS rows), no q/k norms, one gate/up layout, one
        scaling; else None (the Python loop below)."""
        linears = [(l.qkv_w, l.o_w, l.gate_up_w, l.down_w) for l in self.layers]
        ws = [w for group in linears for w in group]
        if self.kind == "bf16":
            fits = all(getattr(w, "onednn", True) is None for w in ws)
        else:
            fits = self.kind == "int8" and all(isinstance(w, Int8Weight) and w.kernel for w in ws)
        if (not fits or any(l.q_norm is not None for l in self.layers)
                or len({l.silu_block for l in self.layers}) != 1
                or len({l.attn.scaling for l in self.layers}) != 1
                or len({tuple(w.out_features for w in group) for group in linears}) != 1
                or not hasattr(torch.ops.streamgate, "llama_layers")):
            return None
        weights = [t for l, (qkv, o, gate_up, down) in zip(self.layers, linears)
                   for t in (l.norm_in, packed_of(qkv), packed_of(o), l.norm_post, packed_of(gate_up), packed_of(down))]
        biases = [w.bias32 for w in ws]
        scales = [w.scales if isinstance(w, Int8Weight) else None for w in ws]
        eps = [float(e) for l in self.layers for e in (l.eps_in, l.eps_post)]
        return weights, biases, scales, eps, [w.out_features for w in linears[0]], self.layers[0].silu_block

    def _bound_layers(self, pools: list, block_size: int):
        """csrc/llama_layers.cpp's LlamaLayers: the weights and this cache's (K, V) pools bound
        once (the cache's row_pools list, the same object every step), so that a step passes
        only its own tensors (the lists took 64-79 us a step to convert)."""
        if self._bound is None or self._bound[0] is not pools:
            weights, biases, scales, eps, out_features, block = self.layer_args
            self._bound = (pools, torch.classes.streamgate.LlamaLayers(
                weights, biases, scales, eps, out_features, block, [k for k, _ in pools], [v for _, v in pools],
                block_size, self.layers[0].attn.scaling, self.heads, self.kv_heads, self.head_dim))
        return self._bound[1]

    def _cos_sin(self, residual: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin [N, head_dim] fp32 of the step's positions: rows of the table
        where the rope type has one (grown to the next power of two past the largest position
        seen, at least 4,096 rows), else the rotary module's, per step. The module computes each
        element from its position alone, so a row is the same either way. Why: the module's
        eight small operators took ~0.14 ms of a one-row SmolLM2 int8 step (8.3 ms, Zen 4 host,
        2026-12-06), every one run with caches the weights' stream had just emptied."""
        if self.rope_table is None:
            return tuple(t[0].float().contiguous() for t in self.rotary_emb(residual[None], position_ids))
        positions = position_ids[0]
        needed = int(positions.max()) + 1
        if needed > self.rope_table[0].shape[0]:
            rows = torch.arange(max(4096, 1 << (needed - 1).bit_length()))[None]
            self.rope_table = tuple(t[0].float().contiguous() for t in self.rotary_emb(residual[None, :1], rows))
        return tuple(torch.index_select(t, 0, positions) for t in self.rope_table)

    def __call__(self, input_ids, position_ids, cache, paged, logits_to_keep, **_):
        ops = torch.ops.streamgate
        residual = torch.index_select(self.embed, 0, input_ids[0])   # [N, C], a new tensor: updated in place below
        cos, sin = self._cos_sin(residual, position_ids)                                    # [N, D] fp32
        n, hd = residual.shape[0], self.head_dim
        q_end = self.heads * hd
        direct = kernel_layers(paged)             # one write and one kernel call a layer where it holds
        kb, pools = direct if direct is not None else (None, None)
        if direct is not None and self.cpp_layers and n <= self.cpp_max_rows:
            hidden = ops.llama_layers(self._bound_layers(pools, cache.block_size), residual, cos, sin,   # one call
                                      paged.slot_mapping, kb.block_tables, kb.q_start, kb.ctx_lens)
            final = ops.add_rms_norm(hidden, residual, self.norm, self.eps)
            return SimpleNamespace(logits=self.lm_head(final[logits_to_keep])[None])
        hidden = x = ops.rms_norm(residual, self.layers[0].norm_in, self.layers[0].eps_in)
        for i, layer in enumerate(self.layers):
            if i:
                x = ops.add_rms_norm(hidden, residual, layer.norm_in, layer.eps_in)
            q, k, v = layer.qkv_w.linear(x).view(n, -1, hd).split(self.qkv_heads, dim=1)     # views of one GEMM
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)                           # new [N, H(_kv), D]
            ops.rotary(q, k, cos, sin)
            if direct is not None:
                k_pool, v_pool = pools[i]
                ops.write_kv(k_pool, v_pool, paged.slot_mapping, k, v)
                out = torch.empty(n, self.heads, hd, dtype=q.dtype)
                ops.paged_attention(q, k_pool, v_pool, kb.block_tables, kb.q_start, kb.ctx_lens, cache.block_size,
                                    layer.attn.scaling, out)
                out = out.view(n, q_end)
            else:
                cache.write(i, k, v, paged.batch(i).slot_mapping)
                out, _ = paged_attention(layer.attn, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], None, scaling=layer.attn.scaling,
                                         sliding_window=layer.window, paged=paged)
                out = out[0].reshape(n, q_end)
            x = ops.add_rms_norm(layer.o_w.linear(out), residual, layer.norm_post, layer.eps_post)
            if layer.silu_block:                       # one pass where it can (packed_linear.Bf16Weight)
                hidden = layer.down_w.linear(layer.gate_up_w.silu_linear(x))
            else:
                hidden = layer.down_w.linear(ops.silu_and_mul(layer.gate_up_w.linear(x)))
        final = ops.add_rms_norm(hidden, residual, self.norm, self.eps)
        return SimpleNamespace(logits=self.lm_head(final[logits_to_keep])[None])
