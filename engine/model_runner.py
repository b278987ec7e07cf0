"""Runs one scheduled batch through the model: packs the batch, builds the attention
metadata once for all layers, and returns the logits of the rows that sample."""

from __future__ import annotations

import logging
import time

import torch

from .attention import AttentionMetadata, CompiledKVCache, GroupBatch
from .attention_kernel import has_features, kernel_batch, register_fakes
from .attention_torch import build_torch_groups
from . import elastic
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs
from .dtypes import native_bf16_cpu, resolve_dtype
from .fused_llama import bf16_widened_here, maybe_fuse
from .kernels import load_kernels, logits_fp32, paged_attention_op
from .kv_cache import PagedKVCache
from .threads import ThreadTuner
from .kv_groups import plan_groups
from .models import load_model, model_config
from .packed_linear import bf16_kernel_only, maybe_pack
from .prompt_logprobs import rows as prompt_logprob_rows
from .scheduler import SchedulerOutput

log = logging.getLogger("streamgate.engine")

_CPU_KV_DEFAULT_GB = 1.0
_CUDA_KV_FRACTION = 0.9


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        # The fused forward runs bf16 on a CPU without bf16 dot products: "auto" is bf16, the pool fits.
        widened = not native_bf16_cpu() and bf16_widened_here(config, model_config(config.model))
        self.dtype, tp = resolve_dtype(config.dtype, self.device, widened), config.tensor_parallel_size
        self.kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else None
        self.model, self.tokenizer, self.family = load_model(config.model, self.dtype, self.device, tp)
        eager_cpu = self.device.type == "cpu" and not config.compile and tp == 1
        self.elastic = config.elastic_threads and eager_cpu and elastic.start(config, self.dtype, widened)  # elastic.py
        hf = self.model.config
        self.vocab_size = hf.vocab_size
        self.max_position_embeddings = getattr(hf, "max_position_embeddings", None)
        num_kv_heads = (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads) // tp   # this rank's
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        # KV-cache groups (kv_groups.py): a hybrid model's sliding layers get their own block
        # tables, whose blocks the block manager returns once they leave the window.
        self.kv_groups = plan_groups(tuple(layer.window for layer in self.family.layers))
        self.num_blocks = config.num_kv_blocks or self._auto_num_blocks(self.kv_groups.rows, num_kv_heads, head_dim)
        plain = all(layer.plain for layer in self.family.layers)
        use_graphs = config.compile and config.cuda_graphs and self.device.type == "cuda" and plain
        # Compiled, one block more than the block manager hands out: the scratch block (block
        # num_blocks) that padded rows read and write. int8 KV: csrc/kv_int8.h's rows.
        pool, hybrid = CompiledKVCache if config.compile else PagedKVCache, self.kv_groups.num_groups > 1
        self.kv_cache = pool(self.kv_groups.rows, self.num_blocks + int(config.compile), config.block_size,
                             num_kv_heads, head_dim, self.dtype, self.device, config.num_swap_blocks,
                             layer_row=self.kv_groups.layer_row if hybrid else None, kv_dtype=self.kv_dtype,
                             populate=config.kv_cache_populate)
        self.layer_group = self.kv_groups.layer_group if hybrid else None
        # The path, decided once: per layer, the kernel or the torch backend (a layer whose
        # features the built kernel lacks takes the torch one); the fused or generic forward.
        if kernel := self._use_kernel(config):
            register_fakes()
        self.on_kernel = tuple(kernel and (layer.plain or has_features()) for layer in self.family.layers)
        self.use_kernel = any(self.on_kernel)
        if self.device.type == "cpu" and not config.compile and load_kernels():
            self.kv_cache.use_kernel()
        self.use_torch = not all(self.on_kernel)
        self.pad_rows = _PAD_ROWS if config.compile and self.use_kernel else 0
        log.info("%s: dtype %s (KV cache %s), attention backend %s, KV-cache groups %s", self.family.model_type,
                 self.dtype, self.kv_cache.k.dtype,
                 "kernel" if not self.use_torch else "torch" if not self.use_kernel else
                 f"kernel on {sum(self.on_kernel)} of {len(self.on_kernel)} layers, torch on the rest",
                 " + ".join(f"{len(ls)} layers {'full' if w is None else f'window {w}'}"
                            for w, ls in zip(self.kv_groups.windows, self.kv_groups.layers)))
        self.forward = maybe_fuse(self.model, config, self.device, self.dtype, self.family) or self.model
        if self.forward is self.model:
            maybe_pack(self.model, config, self.device, self.dtype)
        # Steps of every size are tuned (when asked) only where the kernels give the same bits on
        # any thread count (threads.py): the fused forward on the fp32 kernel or the bf16 block
        # kernel alone; oneDNN, MKL (bf16 in the avx2 build) or int8's run big steps else.
        kind = getattr(self.forward, "kind", None)
        large = config.adaptive_threads_all_steps and (kind == "streamgate" or (kind == "bf16" and bf16_kernel_only()))
        tune = config.adaptive_threads and eager_cpu and not self.elastic       # the pool shares loops itself
        self.threads = ThreadTuner(torch.get_num_threads(), large=large) if tune else None
        self.graphs: DecodeGraphs | None = None
        self.compile_time_s = 0.0
        if use_graphs:                                                # steps with prefill stay eager
            self.graphs = DecodeGraphs(torch.compile(self.model, mode="reduce-overhead", dynamic=True), self.kv_cache,
                                       self.num_blocks, config.max_num_seqs, self.device)
            self.compile_time_s = self.graphs.warm_up()
            log.info("torch.compile + CUDA graphs: decode buckets of 1..%d rows recorded in %.1f s",
                     self.graphs.max_rows, self.compile_time_s)
        elif config.compile:
            self.forward = self._compiled()
        self.last_forward_time = 0.0

    def _compiled(self):
        """torch.compile with symbolic sizes, so one graph serves every batch. With the kernel
        the attention metadata is three tensors and every batch is padded (`_pad`) so that no
        size is 0 or 1: it compiles once, here, on a dummy batch on the scratch block whose
        sizes all differ (torch would take equal sizes for one symbol and recompile when
        they part); its time is logged. With the torch backend the per-group lists are
        guarded on and recompile as batches change (up to dynamo's limit, then eager); it
        compiles here for a decode group beside three prompt chunks."""
        forward = torch.compile(self.model, dynamic=True)
        bs, scratch, dev = self.config.block_size, self.num_blocks, self.device
        start = time.perf_counter()
        with torch.inference_mode():                                 # as in steps: guards tell inference tensors apart
            ids, pos, slots, sample_rows, kernel = [], [], [], [], []
            # (context, new tokens, sampled): 21 rows, 5 sequences, 7 blocks wide, 4 sampled (with _pad).
            for ctx, n, samples in [(6 * bs + 3, 1, True), (9, 9, True), (2 * bs, 4, False), (5, 5, False)]:
                pos += range(ctx - n, ctx)
                slots += (scratch * bs + p % bs for p in range(ctx - n, ctx))
                sample_rows += [len(ids) + n - 1] if samples else []
                ids += [0] * n
                kernel.append((ctx, n, [scratch] * -(-ctx // bs)))
            groups = range(self.kv_groups.num_groups)
            slots_g, kernel_g = [list(slots) for _ in groups], [list(kernel) for _ in groups]
            if self.use_kernel:
                self._pad(ids, pos, slots_g, sample_rows, kernel_g)
            torch_parts = ([0], [kernel[0][0]], [[kernel[0][2]] for _ in groups],
                           [[(row, ctx - n, n, table) for row, (ctx, n, table) in zip((1, 10, 14), kernel[1:])]
                            for _ in groups]) if self.use_torch else ([], [], [[] for _ in groups], [[] for _ in groups])
            meta = self._meta(slots_g, kernel_g if self.use_kernel else [[] for _ in groups], *torch_parts)
            forward(input_ids=torch.tensor([ids], device=dev), position_ids=torch.tensor([pos], device=dev),
                    cache=self.kv_cache, use_cache=False, paged=meta,
                    logits_to_keep=torch.tensor(sample_rows, device=dev))
        self.compile_time_s = time.perf_counter() - start
        log.info("torch.compile: model compiled in %.1f s", self.compile_time_s)
        return forward

    def _pad(self, ids, pos, slots, sample_rows, kernel) -> None:
        """Compiled with the kernel: append a dummy sequence of two rows on the scratch block,
        both sampled (run() drops their logits), so that rows, sequences, sampled rows and
        block-table width are all >= 2 in every step. torch specializes sizes 0 and 1, so
        without it a lone prompt, one sampled row or none each cost one more graph, compiled
        mid-serving (minutes for SmolLM2 on this CPU: docs/BENCHMARKS.md §8.11). slots and
        kernel ((context length, new tokens, block table) per sequence): per KV-cache group."""
        bs, scratch = self.config.block_size, self.num_blocks
        sample_rows += [len(ids), len(ids) + 1]
        ids += [0] * _PAD_ROWS
        pos += [bs - 1, bs]                                            # a 2-block context
        for group_slots, group_kernel in zip(slots, kernel):
            group_slots += [scratch * bs + bs - 1, scratch * bs]
            group_kernel.append((bs + 1, _PAD_ROWS, [scratch, scratch]))

    def _meta(self, slots, kernel, dec_rows, dec_lens, dec_tables, prefills) -> AttentionMetadata:
        """The step's attention metadata; slots, kernel, dec_tables, prefills: per KV-cache group."""
        bs, dev = self.config.block_size, self.device
        batches = []
        for group_slots, group_kernel, group_tables, group_prefills in zip(slots, kernel, dec_tables, prefills):
            batch = GroupBatch(torch.tensor(group_slots, dtype=torch.long, device=dev), [], [])
            if group_kernel:
                batch.kernel = kernel_batch(group_kernel, bs)
            build_torch_groups(batch, bs, dev, dec_rows, group_tables, dec_lens, group_prefills)
            batches.append(batch)
        first = batches[0]
        return AttentionMetadata(self.kv_cache, first.slot_mapping, first.decodes, first.prefills, first.kernel,
                                 layers=self.family.layers, on_kernel=None if not self.use_torch else self.on_kernel,
                                 groups=tuple(batches[1:]), layer_group=self.layer_group)

    def _use_kernel(self, config: EngineConfig) -> bool:
        if config.attention_backend == "torch" or self.device.type != "cpu":
            return False
        if paged_attention_op() is not None:                          # registers torch.ops.streamgate
            return True
        if config.attention_backend == "kernel":
            raise RuntimeError("attention_backend='kernel' but the paged attention kernel did not build (see the log)")
        return False

    def _auto_num_blocks(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        per_block = PagedKVCache.bytes_per_block(num_layers, self.config.block_size, num_kv_heads, head_dim, self.dtype,
                                                 self.kv_dtype)
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * _CUDA_KV_FRACTION
        else:
            budget = _CPU_KV_DEFAULT_GB * 2**30
        num_blocks = max(1, int(budget // per_block))
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.config.block_size,
                 num_blocks * per_block / 2**30)
        return num_blocks

    def check_health(self) -> None:
        """Raise if the runner can no longer step (one process: it always can)."""

    def close(self) -> None:
        """Release what the runner holds beyond memory (one process: nothing)."""

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def swap(self, batch: SchedulerOutput) -> int:
        """Do the step's KV copies to and from the host pool; returns bytes moved."""
        if not (batch.swap_out or batch.swap_in):
            return 0
        moved = self.kv_cache.swap(batch.swap_out, batch.swap_in)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return moved

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> torch.Tensor:
        """Returns float32 logits [K + D + P, V]: one row per sequence that reaches its last
        token this step, in batch order; then the rows of the entries with drafts (1 + drafts
        each, batch order); then the P rows of prompt positions whose prompt logprobs are asked
        (prompt_logprobs.rows; D and P are 0 unless a sequence drafts or a request asks)."""
        if self.graphs is not None and self.graphs.accepts(batch):
            start = time.perf_counter()
            logits = self.graphs.run(batch)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.last_forward_time = time.perf_counter() - start
            return logits
        logits = self.execute(*self._prepare(batch))
        return logits[:logits.shape[0] - self.pad_rows]

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The forward pass on a prepared batch (every tensor-parallel rank runs it)."""
        rows = input_ids.numel()
        if self.elastic:
            elastic.one_torch_thread()
        threads = self.threads.choose(rows) if self.threads else None
        switch = threads is not None and threads != torch.get_num_threads()
        if switch:                                      # a small step on one thread (threads.py)
            torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            logits = self.forward(input_ids=input_ids, position_ids=positions, cache=self.kv_cache,
                                  use_cache=False, paged=meta, logits_to_keep=sample_rows).logits
        finally:
            if switch:
                torch.set_num_threads(self.threads.full)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_time = time.perf_counter() - start
        if threads:
            self.threads.record(rows, threads, self.last_forward_time)
        return logits_fp32(logits[0])                                 # [K, V]

    def _prepare(self, batch: SchedulerOutput):
        bs, dev, groups = self.config.block_size, self.device, range(self.kv_groups.num_groups)
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        dec_rows: list[int] = []
        dec_lens: list[int] = []
        # Per KV-cache group (kv_groups.py): each reads the sequences' tables of its own.
        slots: list[list[int]] = [[] for _ in groups]
        dec_tables: list[list[list[int]]] = [[] for _ in groups]
        prefills: list[list[tuple[int, int, int, list[int]]]] = [[] for _ in groups]   # (row, start, n, table)
        kernel: list[list[tuple[int, int, list[int]]]] = [[] for _ in groups]          # (context, new, table)
        entry_rows: list[int] = []
        draft_rows: list[int] = []                                  # verified rows, after the sampled ones
        for seq, n, samples, is_decode, drafts in zip(batch.seqs, batch.num_new_tokens, batch.samples,
                                                      batch.is_decode, batch.drafts):
            start, row = seq.num_computed_tokens, len(ids)
            entry_rows.append(row)
            ids.extend(seq.token_ids(start, start + n - len(drafts)) + drafts)
            pos.extend(range(start, start + n))
            if drafts:                                              # a decode and its proposals: a chunk
                draft_rows.extend(range(row, row + n))
                is_decode = False
            elif samples:
                sample_rows.append(row + n - 1)
            if self.use_torch and is_decode:
                dec_rows.append(row)
                dec_lens.append(start + 1)
            for g, table in enumerate(seq.block_tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
                # The kernel takes every row, decode or chunk, compiled or eager: since its softmax is
                # vectorized it is level with or ahead of gather + SDPA up to the 512-token budget but
                # for a full chunk deep in a long context (0.95x, docs/BENCHMARKS.md §8.15), and no
                # context is copied. Drafts go as one decode row per position: a short chunk's tile
                # path is ~8x slower a query.
                if self.use_kernel and drafts:
                    kernel[g].extend((start + j + 1, 1, table) for j in range(n))
                elif self.use_kernel:
                    kernel[g].append((start + n, n, table))
                if self.use_torch and is_decode:
                    dec_tables[g].append(table)
                elif self.use_torch:
                    prefills[g].append((row, start, n, table))
        sample_rows += draft_rows
        sample_rows += [entry_rows[i] + off + j for i, off, count in prompt_logprob_rows(batch) for j in range(count)]
        if self.pad_rows:
            self._pad(ids, pos, slots, sample_rows, kernel)
        meta = self._meta(slots, kernel, dec_rows, dec_lens, dec_tables, prefills)
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)      # [1, N]
        positions = torch.tensor([pos], dtype=torch.long, device=dev)      # [1, N]
        sample_t = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return input_ids, positions, sample_t, meta


# Compiled with the kernel, every step gets a dummy sequence of this many rows (`_pad`).
_PAD_ROWS = 2
