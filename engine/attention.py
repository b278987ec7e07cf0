"""Attention over block tables for a packed batch that mixes prefill chunks and decode
tokens, registered with transformers' AttentionInterface as "streamgate_paged".

The model runs on one packed row `[1, N]`. Two backends:
- "kernel" (CPU): the C++ kernel (csrc/, `torch.ops.streamgate.paged_attention`, registered
  by engine.kernels when the runner picks it) attends for every row, decode rows and prefill
  chunks alike, in one call per layer, reading each sequence's keys and values in place
  through its block table; its metadata is the same three tensors every step.
- "torch" (CUDA, and the CPU fallback and reference): single-token rows are batched into
  SDPA calls over their gathered, padded contexts, one call per group of similar context
  lengths (so one long context does not make every stream gather and attend over its
  padding).
Each prefill chunk gets its own SDPA call with a causal mask offset by the tokens already
computed. All index tensors are built once per step (`AttentionMetadata`) and shared by
every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "streamgate_paged"


@dataclass
class PrefillChunk:
    rows: slice                      # the chunk's rows in the packed batch
    context_slots: torch.Tensor | None  # [T] slots of the whole context; None: no earlier context
    mask: torch.Tensor | None        # [q, T] bool, causal with offset; None: plain causal


@dataclass
class DecodeGroup:
    """Single-token rows with similar context lengths, attended in one SDPA call."""
    rows: torch.Tensor               # [B] packed-row index of each single-token row
    slots: torch.Tensor              # [B, T_max] context slots, padded with slot 0
    mask: torch.Tensor               # [B, 1, 1, T_max] True where the slot is real context


@dataclass
class KernelBatch:
    """The sequences the C++ kernel attends for: b owns its query rows q_start[b]:q_start[b+1]."""
    block_tables: torch.Tensor       # [B, W] int64, padded with block 0
    q_start: torch.Tensor            # [B + 1] int64
    ctx_lens: torch.Tensor           # [B] int64, context length including this step's tokens


@dataclass
class AttentionMetadata:
    cache: PagedKVCache
    slot_mapping: torch.Tensor       # [N] where each new token's K/V goes
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    kernel: KernelBatch | None = None   # set: the kernel attends for every row (no groups)


def paged_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0, **kwargs):
    """query [1, H, N, D]; key/value [1, H_kv, N, D] (already written to the pool by the
    cache's update()). Returns ([1, N, H, D], None)."""
    meta: AttentionMetadata = kwargs["paged"]
    layer = module.layer_idx
    q = query[0].transpose(0, 1)                                  # [N, H, D]
    out = torch.empty_like(q)                                     # [N, H, D]
    if (kb := meta.kernel) is not None:
        torch.ops.streamgate.paged_attention(q, meta.cache.k[layer], meta.cache.v[layer], kb.block_tables,
                                             kb.q_start, kb.ctx_lens, meta.cache.block_size, scaling, out)
        return out.unsqueeze(0), None
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads

    for dec in meta.decodes:
        k_ctx, v_ctx = _gather(meta.cache, layer, dec.slots)     # [B, T, H_kv, D]
        b = k_ctx.shape[0]
        qd = q[dec.rows].view(b, num_kv_heads, group, head_dim)    # [B, H_kv, G, D]
        o = F.scaled_dot_product_attention(qd, k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                                           attn_mask=dec.mask, scale=scaling)  # [B, H_kv, G, D]
        out[dec.rows] = o.reshape(b, num_heads, head_dim)

    for chunk in meta.prefills:
        qp = q[chunk.rows].transpose(0, 1).unsqueeze(0)           # [1, H, q, D]
        if chunk.context_slots is None:                            # whole context is this chunk
            kp, vp = key[:, :, chunk.rows], value[:, :, chunk.rows]  # [1, H_kv, q, D]
        else:
            kc, vc = _gather(meta.cache, layer, chunk.context_slots)  # [T, H_kv, D]
            kp, vp = kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0)  # [1, H_kv, T, D]
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                           scale=scaling, enable_gqa=group > 1)  # [1, H, q, D]
        out[chunk.rows] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


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
        kv_write(self.k, layer, slots, key)
        kv_write(self.v, layer, slots, value)


def _gather(cache: PagedKVCache, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager: the cache's gather into its reused scratch buffer. Compiled: plain indexing,
    whose buffers inductor plans itself (a CUDA graph cannot hold the scratch buffer's
    reallocation, and would copy it in as an input on every replay)."""
    if torch.compiler.is_compiling():
        return cache.k[layer][slots], cache.v[layer][slots]
    return cache.gather(layer, slots)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
