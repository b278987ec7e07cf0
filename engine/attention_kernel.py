"""The kernel attention backend (CPU): the C++ kernel (csrc/paged_attention.cpp) attends for
every row of a layer, decode rows and prefill chunks alike, in one call, reading keys and
values in place through the block tables. Its per-step metadata is three tensors
(`KernelBatch`), built here.

Two operators: `paged_attention` for plain layers, and `paged_attention_ext` for layers with
a sliding window (keys before p - window + 1 are neither read nor weighted), attention logit
soft-capping, or per-head sink logits (each a no-op at 0 / None).
"""

from __future__ import annotations

import torch

from .attention import KernelBatch


def has_features() -> bool:
    """Whether the built kernel takes sliding windows, soft-capping and sinks."""
    return hasattr(torch.ops.streamgate, "paged_attention_ext")


def register_fakes() -> None:
    """Shapes for torch.compile (the plain operator's are engine.kernels')."""
    if has_features() and not getattr(register_fakes, "done", False):
        @torch.library.register_fake("streamgate::paged_attention_ext")
        def _(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, window, softcap, sinks, out):
            return None
        register_fakes.done = True


def kernel_batch(entries: list[tuple[int, int, list[int]]], block_size: int) -> KernelBatch:
    """entries: (context length with this step's tokens, new tokens, block table) per sequence."""
    lens = [ctx for ctx, _, _ in entries]
    width = max(-(-n // block_size) for n in lens)
    tables = [table[:width] + [0] * (width - len(table[:width])) for _, _, table in entries]
    q_start = [0]
    for _, n, _ in entries:
        q_start.append(q_start[-1] + n)
    return KernelBatch(torch.tensor(tables, dtype=torch.long), torch.tensor(q_start, dtype=torch.long),
                       torch.tensor(lens, dtype=torch.long))
