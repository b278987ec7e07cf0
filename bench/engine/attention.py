"""Attention alone, both backends side by side on the same random paged pool.

    python -m bench.engine.attention [--seqs 32] [--min-ctx 200] [--max-ctx 1000] [--dtype float32] [--reps 5]
    python -m bench.engine.attention --seqs 1 --min-ctx 512 --max-ctx 512 --chunk 512     # a prefill chunk
    python -m bench.engine.attention --seqs 8 --min-ctx 1100 --max-ctx 1100 --chunk 1,4,16,64,256   # the crossover
    python -m bench.engine.attention --case 32x200-1000/1 --case 1x512-512/512      # several batches, one JSON

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64, 30 layers), one
decode token per sequence (or the last `--chunk` tokens of each context as a prefill
chunk over the rest), contexts of random length; several chunk sizes give the crossover. Times one step's attention over all
layers (median of --reps, the two backends alternating so load on a shared host hits both):
"torch" is the gather (index_select) + SDPA path the engine used before, "kernel" the C++
kernel reading the pool in place; in bf16 on a CPU with AMX, "kernel" runs the query tiles on AMX
tiles and "kernel, no AMX" the same build with them off (`torch.ops.streamgate.amx_tiles`: the
VDPBF16PS tiles an AVX512-BF16 CPU without AMX runs). Decode rows also time the other way to bring
the next span's K/V into cache ("loads" or "prefetch": `torch.ops.streamgate.decode_span_loads`,
csrc/attention_decode.h). "int8 KV" is the kernel over the same K/V quantized into an int8 pool
(kv_cache_dtype "int8", csrc/kv_int8.h): half the bytes, each row widened in registers. Writes --json-out
(bench/results/attention.json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.config_cli import add_engine_args


def parse_case(spec: str) -> tuple[int, int, int, list[int]]:
    """'SEQSxMIN-MAX/CHUNK[,CHUNK...]' (e.g. '32x200-1000/1', '1x2048-2048/512') -> its parts."""
    try:
        seqs, rest = spec.split("x", 1)
        ctx, chunks = rest.split("/", 1)
        lo, hi = ctx.split("-", 1)
        return int(seqs), int(lo), int(hi), [int(c) for c in chunks.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case {spec!r}: expected SEQSxMIN-MAX/CHUNK[,CHUNK...]") from None


def run_case(seqs: int, min_ctx: int, max_ctx: int, chunks: list[int], dtype, reps: int) -> list[dict]:
    """One row per chunk size: median ms of a step's attention over 30 layers, both backends."""
    import torch

    from engine.attention import AttentionMetadata, KernelBatch, paged_attention
    from engine.attention_torch import build_torch_groups
    from engine.kv_cache import PagedKVCache, quantize_rows

    ops = torch.ops.streamgate
    amx = dtype == torch.bfloat16 and ops.amx_tiles()
    layers, heads, kv_heads, dim, bs = 30, 9, 3, 64, 16
    rng = random.Random(0)
    lens = [rng.randint(min_ctx, max_ctx) for _ in range(seqs)]
    num_blocks = sum(-(-n // bs) for n in lens) + 1
    cache = PagedKVCache(layers, num_blocks, bs, kv_heads, dim, dtype, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    cache8 = PagedKVCache(layers, num_blocks, bs, kv_heads, dim, dtype, torch.device("cpu"), kv_dtype=torch.int8)
    cache8.k.copy_(quantize_rows(cache.k))          # the same K/V as an int8 pool (kv_cache_dtype "int8")
    cache8.v.copy_(quantize_rows(cache.v))
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

    loads = ops.decode_span_loads()     # how decode rows bring the next span in: loads, else prefetches
    other_walk = "prefetch" if loads else "loads"                   # the other way, timed beside it
    switchable = ops.decode_span_loads(not loads) is not loads      # builds without AVX-512 have neither
    ops.decode_span_loads(loads)
    parts = hasattr(ops, "decode_parts") and ops.decode_parts()     # decode rows in parts: timed whole beside

    def step(meta, query, key, switch=None) -> float:
        """One step's attention over every layer; `switch` (op, value): a kernel switch set for
        this step only (an A/B of one build: AMX tiles off, the other decode walk)."""
        if switch is not None:
            before = switch[0]()
            switch[0](switch[1])
        try:
            start = time.perf_counter()
            for layer in range(layers):
                Layer.layer_idx = layer
                paged_attention(Layer, query, key, key, None, scaling=dim ** -0.5, paged=meta)
            return time.perf_counter() - start
        finally:
            if switch is not None:
                switch[0](before)

    print(f"{seqs} sequences, contexts {min(lens)}-{max(lens)} ({sum(lens)} tokens), {str(dtype)[6:]}, "
          f"30 layers, median of {reps} (ms per step):")
    print(f"  {'query tokens':>12} {'torch':>9} {'kernel':>9} {'speed-up':>9}  max |diff|"
          + (f"  {'no AMX':>9} {'AMX speed-up':>12}" if amx else "") + f"  {'int8 KV':>9} {'x kernel':>9}"
          + (f"  {other_walk:>9} {'walk speed-up':>13}" if switchable and 1 in chunks else "")
          + (f"  {'one part':>9} {'parts speed-up':>14}" if parts and 1 in chunks else ""))
    out = []
    for n in chunks:
        rows = seqs * n
        torch_meta = AttentionMetadata(cache, torch.zeros(rows, dtype=torch.long), [], [])
        if n == 1:
            build_torch_groups(torch_meta, bs, torch.device("cpu"), list(range(seqs)), tables, lens, [])
        else:
            build_torch_groups(torch_meta, bs, torch.device("cpu"), [], [], [],
                               [(i * n, lens[i] - n, n, t) for i, t in enumerate(tables)])
        kernel_meta = AttentionMetadata(cache, torch_meta.slot_mapping, [], [],
                                        KernelBatch(padded, torch.arange(seqs + 1) * n, torch.tensor(lens)))
        int8_meta = AttentionMetadata(cache8, torch_meta.slot_mapping, [], [], kernel_meta.kernel)
        query = torch.randn(1, heads, rows, dim, dtype=dtype)
        key = torch.randn(1, kv_heads, rows, dim, dtype=dtype)     # a first chunk's own K/V (torch path)
        with torch.inference_mode():
            step(torch_meta, query, key), step(kernel_meta, query, key)
            times = {"torch": [], "kernel": [], **({"kernel_no_amx": []} if amx else {}),
                     **({"kernel_other_walk": []} if switchable and n == 1 else {}),
                     **({"kernel_one_part": []} if parts and n == 1 else {}), "kernel_int8_kv": []}
            for _ in range(reps):
                times["torch"].append(step(torch_meta, query, key))
                times["kernel"].append(step(kernel_meta, query, key))
                if amx:
                    times["kernel_no_amx"].append(step(kernel_meta, query, key, (ops.amx_tiles, False)))
                if switchable and n == 1:
                    times["kernel_other_walk"].append(step(kernel_meta, query, key, (ops.decode_span_loads, not loads)))
                if parts and n == 1:
                    times["kernel_one_part"].append(step(kernel_meta, query, key, (ops.decode_parts, False)))
                times["kernel_int8_kv"].append(step(int8_meta, query, key))
            ref = paged_attention(Layer, query, key, key, None, scaling=dim ** -0.5, paged=torch_meta)[0]
            got = paged_attention(Layer, query, key, key, None, scaling=dim ** -0.5, paged=kernel_meta)[0]
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        # A first chunk (no earlier context) reads its own random K/V on the torch path and the pool
        # in the kernel, so only decode and chunks over context compare outputs.
        diff = float((ref - got).abs().max()) if min(lens) > n else None
        print(f"  {n:>12} {med['torch']:>9.1f} {med['kernel']:>9.1f} {med['torch'] / med['kernel']:>8.2f}x  "
              f"{'not comparable' if diff is None else f'{diff:.1e}'}"
              + (f"  {med['kernel_no_amx']:>9.1f} {med['kernel_no_amx'] / med['kernel']:>11.2f}x" if amx else "")
              + f"  {med['kernel_int8_kv']:>9.1f} {med['kernel_int8_kv'] / med['kernel']:>8.2f}x"
              + (f"  {med['kernel_other_walk']:>9.1f} {med['kernel_other_walk'] / med['kernel']:>12.2f}x"
                 if switchable and n == 1 else "")
              + (f"  {med['kernel_one_part']:>9.1f} {med['kernel_one_part'] / med['kernel']:>13.2f}x"
                 if parts and n == 1 else ""),
              flush=True)
        out.append({"seqs": seqs, "min_ctx": min_ctx, "max_ctx": max_ctx, "context_tokens": sum(lens), "chunk": n,
                    "torch_ms": med["torch"], "kernel_ms": med["kernel"], "max_abs_diff": diff,
                    **({"kernel_no_amx_ms": med["kernel_no_amx"]} if amx else {}),
                    **({"span_loads": loads, "kernel_other_walk_ms": med["kernel_other_walk"]}
                       if switchable and n == 1 else {}),
                    **({"kernel_one_part_ms": med["kernel_one_part"]} if parts and n == 1 else {}),
                    "kernel_int8_kv_ms": med["kernel_int8_kv"]})
    return out


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
    ap.add_argument("--case", action="append", type=parse_case, metavar="SEQSxMIN-MAX/CHUNK",
                    help="a batch to time, repeatable (e.g. 32x200-1000/1 1x512-512/512); replaces "
                         "--seqs/--min-ctx/--max-ctx/--chunk")
    ap.add_argument("--json-out", default="bench/results/attention.json")
    args = ap.parse_args(argv)

    import torch

    from bench.provenance import provenance, write_json
    from engine.kernels import paged_attention_op

    prov = provenance("engine.attention", argv)
    torch.set_num_threads(args.threads)
    if paged_attention_op() is None:                                # also registers torch.ops.streamgate
        raise SystemExit("the paged attention kernel did not build; see the log")
    cases = args.case or [(args.seqs, args.min_ctx, args.max_ctx, [int(c) for c in args.chunk.split(",")])]
    print(f"{args.dtype}, {args.threads} threads")
    rows = [row for case in cases for row in run_case(*case, getattr(torch, args.dtype), args.reps)]
    write_json(args.json_out, prov, args={**vars(args), "case": [list(c) for c in cases]},
               dtype=args.dtype, threads=args.threads, reps=args.reps, rows=rows,
               amx=any("kernel_no_amx_ms" in r for r in rows))
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
