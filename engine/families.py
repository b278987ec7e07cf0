"""What a model family needs from the engine, read once from its Hugging Face config.

`describe(config)` returns a `FamilySpec`: per layer, its sliding window, attention logit
soft-cap and whether it has learned sink logits; the final-logit soft-cap; whether the
fused Llama-shaped forward (fused_llama.py) applies. Everything else a family does
differently (rope per layer type, NoPE layers, partial rotary, q/k norms, embedding and
residual multipliers, MoE blocks) lives in transformers' modeling code, which the generic
path runs with the engine's attention (attention.py) and KV cache. A family the engine
cannot serve is refused here, with the config field that blocks it.

Sliding windows follow transformers' masks: a query at position p attends to keys in
(p - window, p]. A config with `layer_types` slides the layers marked "sliding_attention";
one without slides every layer when `sliding_window` is set if its modeling code does so
(Mistral, Mixtral, Phi-3, Qwen2/3-MoE, Starcoder2: `_GLOBAL_WINDOW`), else none. The attention function checks, per call, that the window the module passes is the
one decided here (attention.py), so a family whose modeling code disagrees fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

# Families served, each verified by greedy parity with HF `generate` (tests/test_parity.py,
# tests/test_families.py). The value: whether the fused Llama-shaped forward applies.
SERVED: dict[str, bool] = {
    "llama": True, "mistral": True, "qwen2": True, "qwen3": True,
    "gemma2": False, "gemma3_text": False, "phi3": False, "smollm3": False, "olmo2": False,
    "granite": False, "qwen3_moe": False, "gpt_oss": False, "mixtral": False,
    "ministral": False, "olmo3": False, "exaone4": False, "cohere2": False, "starcoder2": False,
    "gemma": False, "phi": False, "glm4": False, "helium": False, "seed_oss": False, "cohere": False,
    "arcee": False, "qwen2_moe": False, "olmoe": False, "granitemoe": False,
    "gpt2": False,      # learned absolute positions: wpe(position_ids), the engine's positions
}
# Families without `layer_types` whose every layer slides when `sliding_window` is set.
_GLOBAL_WINDOW = ("mistral", "mixtral", "phi3", "qwen3_moe", "qwen2_moe", "starcoder2")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Config fields that mean a layer keeps a recurrent state (state-space, linear attention,
# short convolutions), for which the engine has no pool beside the paged KV cache.
_RECURRENT_FIELDS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices",
                     "mamba_d_state", "linear_num_key_heads", "conv_L_cache", "ssm_state_size")


class UnsupportedModel(ValueError):
    """A model the engine refuses at load; the message names the blocking config field."""


@dataclass(frozen=True)
class LayerSpec:
    window: int | None = None       # keys in (p - window, p]; None: the whole context
    softcap: float | None = None    # attention logits become softcap * tanh(logits / softcap)
    sinks: bool = False             # a learned per-head sink logit joins the softmax (gpt-oss)

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and not self.sinks


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    layers: tuple[LayerSpec, ...]
    final_softcap: float | None     # applied by the model's own head (generic path only)
    fused: bool                     # the fused Llama-shaped forward applies
    moe: bool                       # transformers' MoE blocks run the MLPs

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows, None (full attention) included if any layer has it."""
        return tuple(sorted({layer.window for layer in self.layers}, key=lambda w: (w is not None, w or 0)))

    @property
    def sliding(self) -> bool:
        return any(layer.window is not None for layer in self.layers)


def describe(config) -> FamilySpec:
    """The engine's reading of `config` (a transformers PretrainedConfig); raises
    UnsupportedModel naming the field that makes the model unservable."""
    family = getattr(config, "model_type", None) or "?"
    num_layers = getattr(config, "num_hidden_layers", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        for i, kind in enumerate(layer_types):
            if kind not in ATTENTION_LAYER_TYPES:
                raise UnsupportedModel(
                    f"model family {family!r}: config.layer_types[{i}] = {kind!r} is not supported: only "
                    f"{' and '.join(ATTENTION_LAYER_TYPES)} layers run on the paged KV cache (linear-attention, "
                    f"state-space and convolution layers keep a recurrent state the engine has no pool for)")
    for field in _RECURRENT_FIELDS:
        if getattr(config, field, None) not in (None, [], ()):
            raise UnsupportedModel(f"model family {family!r}: config.{field} is set: layers with a recurrent state "
                                   f"(state-space, linear attention, convolution) are not supported")
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedModel(f"model family {family!r}: config.attention_chunk_size = {config.attention_chunk_size}: "
                               f"chunked attention is not supported")
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedModel(f"model family {family!r}: config.add_cross_attention is set: cross-attention "
                               f"(an encoder's states) is not supported")
    if family not in SERVED:
        raise UnsupportedModel(f"model family {family!r} (config.model_type) is not supported by the paged engine "
                               f"(supported: {', '.join(SERVED)})")
    window = getattr(config, "sliding_window", None) or None
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise UnsupportedModel(f"model family {family!r}: config.layer_types has {len(layer_types)} entries "
                                   f"for num_hidden_layers = {num_layers}")
        windows = [window if kind == "sliding_attention" else None for kind in layer_types]
        if any(kind == "sliding_attention" for kind in layer_types) and window is None:
            raise UnsupportedModel(f"model family {family!r}: config.layer_types has sliding_attention layers "
                                   f"but config.sliding_window is not set")
    else:
        windows = [window if family in _GLOBAL_WINDOW else None] * num_layers
    softcap = getattr(config, "attn_logit_softcapping", None) or None
    sinks = family == "gpt_oss"
    layers = tuple(LayerSpec(w, softcap, sinks) for w in windows)
    moe = any(getattr(config, f, None) for f in ("num_experts", "num_local_experts", "n_routed_experts"))
    return FamilySpec(family, layers, getattr(config, "final_logit_softcapping", None) or None,
                      SERVED[family] and not moe, moe)
