"""The torch attention backend (CUDA, and the CPU fallback and reference): SDPA over
gathered contexts, with its per-step metadata builder.

Single-token rows (decodes) are grouped by context length (a group pads to at most 1.5x its
shortest context) and each group is one SDPA call over its gathered contexts, with
grouped-query heads folded so K/V are never repeated; each prefill chunk gets its own call
with a causal mask offset by the tokens already computed. A sliding layer's mask also cuts
keys at or before p - window, built once per step and window on first use (`mask_for`). A
layer with logit soft-capping or sink logits, which SDPA cannot take, runs the same math
written out (`_attend_eager`, as transformers' eager attention does it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .families import LayerSpec
from .kv_cache import PagedKVCache

# A decode group may pad its rows up to this factor of its shortest context (plus a block)
# before a new group starts: one more gather+SDPA call per layer is cheaper than attending
# over that much padding.
_GROUP_SLACK = 1.5


@dataclass
class PrefillChunk:
    rows: slice                      # the chunk's rows in the packed batch
    context_slots: torch.Tensor | None  # [T] slots of the whole context; None: no earlier context
    mask: torch.Tensor | None        # [q, T] bool, causal with offset; None: plain causal
    start: int = 0                   # the chunk's first position (tokens already computed)
    windowed: dict = field(default_factory=dict)   # window -> [q, T] mask, built on first use

    def mask_for(self, window: int | None, device) -> torch.Tensor | None:
        if window is None:
            return self.mask
        if window not in self.windowed:                # keys 0..start+q-1, queries at start..start+q-1
            n = self.rows.stop - self.rows.start
            q_pos = torch.arange(self.start, self.start + n, device=device)[:, None]
            keys = torch.arange(self.start + n, device=device)[None, :]
            self.windowed[window] = (keys <= q_pos) & (keys > q_pos - window)
        return self.windowed[window]


@dataclass
class DecodeGroup:
    """Single-token rows with similar context lengths, attended in one SDPA call."""
    rows: torch.Tensor               # [B] packed-row index of each single-token row
    slots: torch.Tensor              # [B, T_max] context slots, padded with slot 0
    mask: torch.Tensor               # [B, 1, 1, T_max] True where the slot is real context
    lens: torch.Tensor | None = None  # [B] context lengths (needed for sliding layers)
    windowed: dict = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self.windowed:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)[None, :]
            self.windowed[window] = self.mask & (keys >= (self.lens[:, None] - window))[:, None, None, :]
        return self.windowed[window]


def torch_attention(cache: PagedKVCache, meta, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    out: torch.Tensor, scaling: float, spec: LayerSpec, sinks: torch.Tensor | None) -> None:
    """q/out [N, H, D]; key/value [1, H_kv, N, D] (the step's new rows, already in the pool);
    meta: the layer's KV-cache group's decodes and prefills."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    eager = spec.softcap is not None or sinks is not None
    for dec in meta.decodes:
        k_ctx, v_ctx = _gather(cache, layer, dec.slots)     # [B, T, H_kv, D]
        b = k_ctx.shape[0]
        qd = q[dec.rows].view(b, num_kv_heads, group, head_dim)    # [B, H_kv, G, D]
        mask = dec.mask_for(spec.window)
        if eager:
            s = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
            o = _attend_eager(qd, k_ctx.transpose(1, 2), v_ctx.transpose(1, 2), mask, scaling, spec.softcap, s)
        else:
            o = F.scaled_dot_product_attention(qd, k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                                               attn_mask=mask, scale=scaling)  # [B, H_kv, G, D]
        out[dec.rows] = o.reshape(b, num_heads, head_dim)

    for chunk in meta.prefills:
        qp = q[chunk.rows].transpose(0, 1).unsqueeze(0)           # [1, H, q, D]
        if chunk.context_slots is None and not cache.quantized:   # whole context is this chunk
            kp, vp = key[:, :, chunk.rows], value[:, :, chunk.rows]  # [1, H_kv, q, D]
        else:
            # An int8 pool's rows are read back even for the chunk itself: what the kernel attends to.
            slots = meta.slot_mapping[chunk.rows] if chunk.context_slots is None else chunk.context_slots
            kc, vc = _gather(cache, layer, slots)                  # [T, H_kv, D]
            kp, vp = kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0)  # [1, H_kv, T, D]
        mask = chunk.mask_for(spec.window, q.device)
        if eager:
            if mask is None:
                n = qp.shape[2]
                mask = torch.ones(n, n, dtype=torch.bool, device=qp.device).tril()
            kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)   # [1, H, T, D]
            s = None if sinks is None else sinks.view(1, num_heads, 1, 1)
            o = _attend_eager(qp, kp, vp, mask, scaling, spec.softcap, s)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                               scale=scaling, enable_gqa=group > 1)  # [1, H, q, D]
        out[chunk.rows] = o[0].transpose(0, 1)


def _attend_eager(q, k, v, mask, scaling: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, X, M, D], k/v [B, X, T, D], mask broadcastable to [B, X, M, T] (True: attend),
    sinks broadcastable to [B, X, M, 1]: softmax(softcap(q k^T * scaling) ++ sink) v, the sink
    column dropped after the softmax (transformers' eager attention for Gemma 2 / gpt-oss)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs.to(v.dtype), v)


def _gather(cache: PagedKVCache, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager: the cache's gather into its reused scratch buffer. Compiled: plain indexing,
    whose buffers inductor plans itself (a CUDA graph cannot hold the scratch buffer's
    reallocation, and would copy it in as an input on every replay)."""
    if torch.compiler.is_compiling():
        return cache.k[cache.row(layer)][slots], cache.v[cache.row(layer)][slots]
    return cache.gather(layer, slots)


# -- the per-step metadata ----------------------------------------------------------------------
def build_torch_groups(meta, block_size: int, device, dec_rows, dec_tables, dec_lens, prefills) -> None:
    """Decode groups of similar context length and per-chunk masks for the torch backend."""
    order = sorted(range(len(dec_rows)), key=dec_lens.__getitem__)
    for group in _length_groups([dec_lens[i] for i in order]):
        idx = [order[i] for i in group]
        lens = [dec_lens[i] for i in idx]
        t_max = lens[-1]
        width = -(-t_max // block_size)
        tables = torch.tensor([_readable(dec_tables[i][:width]) + [0] * (width - len(dec_tables[i][:width]))
                               for i in idx], dtype=torch.long, device=device)   # [B, blocks]
        lens_t = torch.tensor(lens, device=device)
        meta.decodes.append(DecodeGroup(
            rows=torch.tensor([dec_rows[i] for i in idx], dtype=torch.long, device=device),
            slots=block_slots(tables, block_size)[:, :t_max],                # [B, T_max]
            mask=(torch.arange(t_max, device=device)[None, :] < lens_t[:, None])[:, None, None, :],
            lens=lens_t))
    for row, start, n, table in prefills:
        chunk = PrefillChunk(slice(row, row + n), None, None, start)
        if start > 0:                                                    # attends to earlier context
            length = start + n
            table_t = torch.tensor(_readable(table[:-(-length // block_size)]), dtype=torch.long, device=device)
            chunk.context_slots = block_slots(table_t[None], block_size)[0, :length]  # [T]
            q_pos = torch.arange(start, length, device=device)
            chunk.mask = torch.arange(length, device=device)[None, :] <= q_pos[:, None]   # [q, T]
        meta.prefills.append(chunk)


def _readable(table: list[int]) -> list[int]:
    """A table whose entries returned by a sliding window (block_manager.FREED, negative)
    point at block 0: they lie before every query's window, so the masks never let them in."""
    return [max(b, 0) for b in table]


def block_slots(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block tables [B, nb] -> token slots [B, nb * block_size]."""
    offsets = torch.arange(block_size, device=tables.device)
    return (tables[:, :, None] * block_size + offsets).reshape(tables.shape[0], -1)


def _length_groups(sorted_lens: list[int]) -> list[list[int]]:
    """Split ascending context lengths into runs of similar length (returns index lists)."""
    groups: list[list[int]] = []
    for i, n in enumerate(sorted_lens):
        if groups and n <= _GROUP_SLACK * sorted_lens[groups[-1][0]] + 16:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
