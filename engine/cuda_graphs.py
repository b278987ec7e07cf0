"""Decode steps replayed as CUDA graphs, one per bucket of batch shape (CUDA only).

A decode step on a GPU is launch-bound: 30 layers of small kernels take longer to launch
than to run. torch.compile's mode="reduce-overhead" records each compiled graph as a CUDA
graph (cudagraph trees) and replays it, but one recording serves one set of input shapes.
So decode-only steps are padded to a bucket, a power of two of rows (sequences) and of
context blocks, as vLLM pads to its capture sizes: a few dozen recordings cover every step.
Padded rows read and write only the scratch block, a KV block past the ones the block
manager hands out, and are not sampled. Steps with prefill run eager (they are
compute-bound; their shapes vary too much to record).
"""

from __future__ import annotations

import logging
import time

import torch
from torch.fx.experimental import _config as shape_config

from .attention import AttentionMetadata, DecodeGroup
from .kv_cache import PagedKVCache
from .scheduler import SchedulerOutput

log = logging.getLogger("streamgate.engine")


def bucket(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class DecodeGraphs:
    """`forward` is the model compiled with mode="reduce-overhead" (the runner's), or the
    model itself (the CPU test of the padding)."""

    def __init__(self, forward, cache: PagedKVCache, scratch_block: int, max_rows: int, device: torch.device):
        self.forward, self.cache, self.scratch, self.device = forward, cache, scratch_block, device
        self.max_rows = bucket(max_rows)
        self.num_steps = 0                                  # decode steps run padded (recorded or replayed)
        # The pool is written in place by every step: as a static address it is neither
        # copied into the recording's input buffers nor a reason to skip recording.
        torch._dynamo.mark_static_address(cache.k)
        torch._dynamo.mark_static_address(cache.v)

    def accepts(self, batch: SchedulerOutput) -> bool:
        """A step of single-token rows that all sample (decodes, or prompts' last token)."""
        return (len(batch.seqs) <= self.max_rows and all(n == 1 for n in batch.num_new_tokens)
                and all(batch.samples))

    def warm_up(self) -> float:
        """Compile and record the 1- and 2-block buckets of every row count, which covers
        every graph torch compiles (it specializes sizes of 1: rows, blocks); wider
        contexts only record more CUDA graphs later. Returns seconds."""
        start = time.perf_counter()
        for width in (1, 2):
            rows = 1
            while rows <= self.max_rows:
                for _ in range(3):                      # cudagraph trees: warm-up run, record, replay
                    self._forward([0] * rows, [width * self.cache.block_size - 1] * rows,
                                  [[self.scratch] * width] * rows, rows)
                rows *= 2
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> torch.Tensor:
        """Float32 logits [B, V] of the step's B rows, in batch order."""
        bs = self.cache.block_size
        ids, positions, tables = [], [], []
        for seq in batch.seqs:
            pos = seq.num_computed_tokens
            ids.extend(seq.token_ids(pos, pos + 1))
            positions.append(pos)
            tables.append(seq.block_table[:pos // bs + 1])
        self.num_steps += 1
        return self._forward(ids, positions, tables, len(batch.seqs))

    def _forward(self, ids: list[int], positions: list[int], tables: list[list[int]], num_real: int) -> torch.Tensor:
        bs, dev, pad = self.cache.block_size, self.device, self.scratch
        rows = bucket(len(ids))
        width = bucket(max(len(t) for t in tables))
        ids = ids + [0] * (rows - len(ids))
        lens = [p + 1 for p in positions] + [1] * (rows - len(positions))
        tables = [t + [pad] * (width - len(t)) for t in tables] + [[pad] * width] * (rows - len(tables))
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]
        tables_t = torch.tensor(tables, dtype=torch.long, device=dev)                     # [R, W]
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)                         # [R]
        context = (tables_t[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(rows, -1)  # [R, W * bs]
        mask = (torch.arange(width * bs, device=dev)[None, :] < lens_t[:, None])[:, None, None, :]
        meta = AttentionMetadata(self.cache, torch.tensor(slots, dtype=torch.long, device=dev),
                                 [DecodeGroup(torch.arange(rows, device=dev), context, mask)], [])
        torch.compiler.cudagraph_mark_step_begin()
        # Without duck shapes: rows and context width equal when first traced would be
        # guarded equal, and recompile when they part.
        with shape_config.patch(use_duck_shape=False):
            logits = self.forward(input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
                                  position_ids=(lens_t - 1)[None], cache=self.cache, use_cache=False, paged=meta,
                                  logits_to_keep=0).logits                              # [1, R, V]
        # The recording owns its output buffer and the next replay overwrites it: copy.
        return logits[0, :num_real].to(torch.float32, copy=True)                          # [B, V]
