"""Attention alone, both backends side by side on the same random paged pool.

    python -m bench.engine.attention [--seqs 32] [--min-ctx 200] [--max-ctx 1000] [--dtype float32] [--reps 5]
    python -m bench.engine.attention --seqs 1 --min-ctx 512 --max-ctx 512 --chunk 512     # a prefill chunk
    python -m bench.engine.attention --seqs 8 --min-ctx 1100 --max-ctx 1100 --chunk 1,4,16,64,256   # the crossover

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64, 30 layers), one
decode token per sequence (or the last `--chunk` tokens of each context as a prefill
chunk over the rest), contexts of random length; several chunk sizes give the crossover. Times one step's attention over all
layers (median of --reps, the two backends alternating so load on a shared host hits both):
"torch" is the gather (index_select) + SDPA path the engine used before, "kernel" the C++
kernel reading the pool in place.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.config_cli import add_engine_args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--min-ctx", type=int, default=200)
    ap.add_argument("--max-ctx", type=int, default=1000)
    add_engine_args(ap, only=("dtype",))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", default="1", help="query tokens per sequence, comma-separated sizes to compare "
                    "(1: decode; n > 1: the last n tokens of each context as a prefill chunk)")
    args = ap.parse_args(argv)

    import torch

    from engine.attention import AttentionMetadata, KernelBatch, paged_attention
    from engine.kernels import paged_attention_op
    from engine.kv_cache import PagedKVCache
    from engine.attention_torch import build_torch_groups

    torch.set_num_threads(args.threads)
    if paged_attention_op() is None:                                # also registers torch.ops.streamgate
        raise SystemExit("the paged attention kernel did not build; see the log")
    dtype = getattr(torch, args.dtype)
    layers, heads, kv_heads, dim, bs = 30, 9, 3, 64, 16
    rng = random.Random(0)
    lens = [rng.randint(args.min_ctx, args.max_ctx) for _ in range(args.seqs)]
    num_blocks = sum(-(-n // bs) for n in lens) + 1
    cache = PagedKVCache(layers, num_blocks, bs, kv_heads, dim, dtype, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    perm = list(range(1, num_blocks))
    rng.shuffle(perm)
    tables = []
    for n in lens:
        w = -(-n // bs)
        tables.append(perm[:w])
        perm = perm[w:]

    # The torch backend's metadata comes from its own builder (engine/attention_torch.py).
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])

    class Layer:
        layer_idx = 0

    def step(meta, query, key) -> float:
        start = time.perf_counter()
        for layer in range(layers):
            Layer.layer_idx = layer
            paged_attention(Layer, query, key, key, None, scaling=dim ** -0.5, paged=meta)
        return time.perf_counter() - start

    print(f"{args.seqs} sequences, contexts {min(lens)}-{max(lens)} ({sum(lens)} tokens), {args.dtype}, "
          f"{args.threads} threads, 30 layers, median of {args.reps} (ms per step):")
    print(f"  {'query tokens':>12} {'torch':>9} {'kernel':>9} {'speed-up':>9}  max |diff|")
    for n in [int(c) for c in args.chunk.split(",")]:
        rows = args.seqs * n
        torch_meta = AttentionMetadata(cache, torch.zeros(rows, dtype=torch.long), [], [])
        if n == 1:
            build_torch_groups(torch_meta, bs, torch.device("cpu"), list(range(args.seqs)), tables, lens, [])
        else:
            build_torch_groups(torch_meta, bs, torch.device("cpu"), [], [], [],
                               [(i * n, lens[i] - n, n, t) for i, t in enumerate(tables)])
        kernel_meta = AttentionMetadata(cache, torch_meta.slot_mapping, [], [],
                                        KernelBatch(padded, torch.arange(args.seqs + 1) * n, torch.tensor(lens)))
        query = torch.randn(1, heads, rows, dim, dtype=dtype)
        key = torch.randn(1, kv_heads, rows, dim, dtype=dtype)     # a first chunk's own K/V (torch path)
        with torch.inference_mode():
            step(torch_meta, query, key), step(kernel_meta, query, key)
            times = {"torch": [], "kernel": []}
            for _ in range(args.reps):
                times["torch"].append(step(torch_meta, query, key))
                times["kernel"].append(step(kernel_meta, query, key))
            ref = paged_attention(Layer, query, key, key, None, scaling=dim ** -0.5, paged=torch_meta)[0]
            got = paged_attention(Layer, query, key, key, None, scaling=dim ** -0.5, paged=kernel_meta)[0]
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        # A first chunk (no earlier context) reads its own random K/V on the torch path and the pool
        # in the kernel, so only decode and chunks over context compare outputs.
        diff = f"{float((ref - got).abs().max()):.1e}" if min(lens) > n else "not comparable"
        print(f"  {n:>12} {med['torch']:>9.1f} {med['kernel']:>9.1f} {med['torch'] / med['kernel']:>8.2f}x  {diff}",
              flush=True)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
