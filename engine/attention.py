"""Attention over block tables for a packed batch that mixes prefill chunks and decode
tokens, registered with transformers' AttentionInterface as "streamgate_paged".

The model runs on one packed row `[1, N]`. Two backends, one file each, each with the
metadata builder the runner calls once per step:
- "kernel" (CPU, attention_kernel.py): the C++ kernel (csrc/) attends for every row, decode
  rows and prefill chunks alike, in one call per layer, reading each sequence's keys and
  values in place through its block table; its metadata is the same three tensors every step.
- "torch" (CUDA, and the CPU fallback and reference, attention_torch.py): single-token rows
  are batched into SDPA calls over their gathered, padded contexts, one call per group of
  similar context lengths; each prefill chunk gets its own call with a causal mask offset by
  the tokens already computed.
Both take each layer's features from the family description (families.py): a sliding
window, attention logit soft-capping and learned sink logits, with the scaling the module
passes (e.g. Gemma's `query_pre_attn_scalar`). The family's own modeling code passes the same
window, soft-cap and sinks in every call; they are checked against the description, so a
description that disagrees with the model fails on its first step rather than diverging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from .attention_torch import DecodeGroup, PrefillChunk, torch_attention
from .families import LayerSpec
from .kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "streamgate_paged"
_PLAIN = LayerSpec()

__all__ = ["ATTN_IMPLEMENTATION", "AttentionMetadata", "DecodeGroup", "GroupBatch", "KernelBatch", "PrefillChunk",
           "kernel_layers", "paged_attention", "CompiledKVCache"]


@dataclass
class KernelBatch:
    """The sequences the C++ kernel attends for: b owns its query rows q_start[b]:q_start[b+1]."""
    block_tables: torch.Tensor       # [B, W] int64, padded with block 0
    q_start: torch.Tensor            # [B + 1] int64
    ctx_lens: torch.Tensor           # [B] int64, context length including this step's tokens


@dataclass
class GroupBatch:
    """One KV-cache group's view of the step (kv_groups.py): its slots and tables."""
    slot_mapping: torch.Tensor       # [N] where each new token's K/V goes
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    kernel: KernelBatch | None = None


@dataclass
class AttentionMetadata:
    """The step's attention metadata. Its own slot_mapping / decodes / prefills / kernel are
    the first KV-cache group's; a hybrid model's other groups are in `groups`, and layer l
    reads `batch(l)`."""
    cache: PagedKVCache
    slot_mapping: torch.Tensor       # [N] where each new token's K/V goes
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    kernel: KernelBatch | None = None   # set: the kernel attends for the layers it serves
    layers: tuple[LayerSpec, ...] | None = None   # per layer features (families.py); None: all plain
    on_kernel: tuple[bool, ...] | None = None     # per layer: the kernel attends (else torch); None: all
    groups: tuple[GroupBatch, ...] = ()           # KV-cache groups 1.. (hybrid models)
    layer_group: tuple[int, ...] | None = None    # per layer: its group; None: all in the first

    def batch(self, layer: int) -> "AttentionMetadata | GroupBatch":
        """The slots and tables `layer` reads and writes (its KV-cache group's)."""
        g = 0 if self.layer_group is None else self.layer_group[layer]
        return self if g == 0 else self.groups[g - 1]


def paged_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0, sliding_window=None,
                    softcap=None, s_aux=None, **kwargs):
    """query [1, H, N, D]; key/value [1, H_kv, N, D] (already written to the pool by the
    cache's update()). Returns ([1, N, H, D], None)."""
    meta: AttentionMetadata = kwargs["paged"]
    layer = module.layer_idx
    spec = meta.layers[layer] if meta.layers is not None else _PLAIN
    if ((sliding_window or None) != spec.window or (softcap or None) != spec.softcap
            or (s_aux is not None) != spec.sinks):
        raise RuntimeError(f"layer {layer}: the model passes sliding_window={sliding_window}, softcap={softcap}, "
                           f"sinks={s_aux is not None}; the family description (engine/families.py) says {spec}")
    q = query[0].transpose(0, 1)                                  # [N, H, D]
    out = torch.empty_like(q)                                     # [N, H, D]
    batch, cache = meta.batch(layer), meta.cache
    if (kb := batch.kernel) is not None and (meta.on_kernel is None or meta.on_kernel[layer]):
        k_pool, v_pool = cache.k[cache.row(layer)], cache.v[cache.row(layer)]
        if spec.plain:
            torch.ops.streamgate.paged_attention(q, k_pool, v_pool, kb.block_tables, kb.q_start,
                                                 kb.ctx_lens, cache.block_size, scaling, out)
        else:
            sinks = None if s_aux is None else s_aux.detach().float().contiguous()
            torch.ops.streamgate.paged_attention_ext(q, k_pool, v_pool, kb.block_tables, kb.q_start,
                                                     kb.ctx_lens, cache.block_size, scaling, spec.window or 0,
                                                     spec.softcap or 0.0, sinks, out)
        return out.unsqueeze(0), None
    torch_attention(cache, batch, layer, q, key, value, out, scaling, spec, s_aux)
    return out.unsqueeze(0), None


def kernel_layers(meta: AttentionMetadata) -> tuple[KernelBatch, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """(the step's kernel batch, each layer's (K, V) pools) where every layer attends with the
    plain kernel call (no window, soft-cap or sinks), in one KV-cache group, and the cache
    writes through the kernels' write_kv: the fused forward then writes and attends with one
    operator call each a layer, without paged_attention's checks, views and lookups (~1 ms of
    a one-row SmolLM2 step); else None."""
    cache, kb = meta.cache, meta.kernel
    if (kb is None or meta.layer_group is not None or cache.layer_row is not None or not cache.writes_on_kernel
            or (meta.on_kernel is not None and not all(meta.on_kernel))
            or (meta.layers is not None and not all(spec.plain for spec in meta.layers))):
        return None
    return kb, cache.row_pools()


@torch.library.custom_op("streamgate::kv_write", mutates_args=("pool",))
def kv_write(pool: torch.Tensor, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[layer][slots] = rows, as one opaque op that declares what it mutates."""
    pool[layer].index_copy_(0, slots, rows)


@kv_write.register_fake
def _(pool, layer, slots, rows) -> None:
    return None


class CompiledKVCache(PagedKVCache):
    """The pool for a compiled model. torch.compile turns an in-place write into a graph
    input (the pool) into an out-of-place one plus a copy of the whole pool back, per layer
    and step: a compiled SmolLM2 step ran 2-10x slower than eager, two thirds of it copying
    (docs/BENCHMARKS.md §8.11). A custom op that declares the mutation is written in place."""

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        kv_write(self.k, self.row(layer), slots, key)
        kv_write(self.v, self.row(layer), slots, value)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
