"""Tiny random models of every served family (engine/families.py), built from transformers'
config classes with SmolLM2's tokenizer, and their Hugging Face eager references.

Windows are small (24 tokens, not a multiple of the block size) so that the test prompts
cross them several times; soft-caps are small enough to bend the random models' logits."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

WINDOW = 24
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=0.2,
             tie_word_embeddings=False)
_ALTERNATE = ["sliding_attention", "full_attention"]
_MOE = dict(num_experts_per_tok=2, intermediate_size=64)

_MOE_EXTRA = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_SLIDING = dict(sliding_window=WINDOW, layer_types=_ALTERNATE)

# family -> (model_type, config overrides)
FAMILIES = {
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "gemma2": ("gemma2", dict(_SLIDING, attn_logit_softcapping=3.0, final_logit_softcapping=8.0,
                              query_pre_attn_scalar=24)),
    "gemma3_text": ("gemma3_text", dict(_SLIDING, query_pre_attn_scalar=24)),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5)),
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0])),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                logits_scaling=2.0)),
    "qwen3_moe": ("qwen3_moe", dict(_MOE, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1,
                                    mlp_only_layers=[])),
    "gpt_oss": ("gpt_oss", dict(_MOE, **_SLIDING, num_local_experts=4)),
    "mixtral": ("mixtral", dict(_MOE, num_local_experts=4)),
    # Dense, Llama-shaped, with every layer sliding: the fused forward's sliding path.
    "qwen3-sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    # More families on transformers' forward, checked with a lighter workload.
    "ministral": ("ministral", _SLIDING), "olmo3": ("olmo3", _SLIDING), "exaone4": ("exaone4", _SLIDING),
    "cohere2": ("cohere2", _SLIDING), "starcoder2": ("starcoder2", dict(sliding_window=WINDOW)),
    "gemma": ("gemma", {}), "phi": ("phi", {}), "glm4": ("glm4", {}), "helium": ("helium", {}),
    "seed_oss": ("seed_oss", {}), "cohere": ("cohere", {}), "arcee": ("arcee", {}),
    "qwen2_moe": ("qwen2_moe", _MOE_EXTRA), "olmoe": ("olmoe", _MOE_EXTRA),
    "granitemoe": ("granitemoe", dict(_MOE_EXTRA, num_local_experts=4)),
    # Rope scaling types, scaled from 64 original positions so the test prompts pass them.
    "llama-rope-llama3": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen3-rope-yarn": ("qwen3", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    # longrope switches every position to its long factors once a forward's largest position
    # passes the original length, which batching and chunking change (see ENGINE.md): here
    # the short factors only, as for contexts within Phi-4-mini's original 4k.
    "phi3-rope-longrope": ("phi3", dict(original_max_position_embeddings=2048, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=2048,
        short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)]))),
    # Learned absolute positions (wpe); GPT-2 has no grouped KV heads.
    "gpt2": ("gpt2", dict(num_key_value_heads=4)),
}


def build_family_model(family: str, out: Path, tokenizer_dir: str) -> str:
    """A random ~4M-parameter model of `family`, saved with SmolLM2's tokenizer."""
    from transformers import AutoConfig

    model_type, extra = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=None, **{**_BASE, **extra})
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():                       # gpt-oss's sinks start at 0: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.normal_(0.0, 2.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@lru_cache(maxsize=4)
def load_eager_reference(model_dir: str, dtype: str = "float32"):
    """The HF model with transformers' eager attention: the reference math for soft-capping
    and sinks (SDPA takes neither), and for sliding windows through its own masks."""
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                dtype=getattr(torch, dtype)).eval()
