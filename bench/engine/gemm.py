"""SmolLM2's linear layers alone, in every form the engine can run them, side by side.

    python -m bench.engine.gemm [--rows 1,2,4,8,32,256] [--threads 2] [--reps 50] [--json-out bench/results/gemm.json]
    python -m bench.engine.gemm --crossover [--rows 1,2,4,8,16,32,64,128,512] [--reps 30] [--layers o,down]

For each layer shape (fused q/k/v, o, fused gate/up, down, lm_head) and row count: the C++
kernel on fp32 weights packed for it (`streamgate::linear`), MKL's fp32 `F.linear`, torch's
bf16 `F.linear`, oneDNN's bf16 matmul on weights prepacked for it and the bf16 block kernel
(`streamgate::linear_bf16`; the fused Llama forward in bf16 runs it at every step where it is
the VDPBF16PS form without AMX, engine/packed_linear.py's `bf16_kernel_only()`, and elsewhere up
to BF16_KERNEL_MAX_ROWS rows, oneDNN above). Median of --reps calls
each, the forms alternating per shape. --crossover times only the two bf16 forms the engine
chooses between, alternating call by call (a shared host's load falls on both), and prints
each one's GFLOP/s, the ratio of medians and the load average. Where
the CPU has no bf16 dot products (no AVX512-BF16, no AMX) the bf16 columns are emulated and
slow (docs/BENCHMARKS.md §8.2); where it has them they are what `dtype="auto"` picks (§8.16).
"""

from __future__ import annotations

import argparse
import time

SHAPES = [(960, 576, "q/k/v"), (576, 576, "o"), (3072, 576, "gate/up"), (576, 1536, "down"), (49152, 576, "lm_head")]


def median_ms(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def median_pair_ms(fa, fb, reps: int) -> tuple[float, float]:
    """Medians of `fa` and `fb` timed alternately, the order flipping every rep."""
    for f in (fa, fb, fa, fb):
        f()
    ta, tb = [], []
    for i in range(reps):
        for f, out in ((fa, ta), (fb, tb)) if i % 2 == 0 else ((fb, tb), (fa, ta)):
            t = time.perf_counter()
            f()
            out.append(time.perf_counter() - t)
    return sorted(ta)[reps // 2] * 1e3, sorted(tb)[reps // 2] * 1e3


def crossover(args, prov) -> int:
    """The bf16 block kernel against oneDNN's prepacked bf16 matmul, alternating."""
    import os

    import torch

    from bench.provenance import write_json
    from engine.kernels import load_kernels, loaded_variant

    torch.set_num_threads(args.threads)
    if not load_kernels():
        print("the C++ kernels did not build")
        return 1
    ops = torch.ops.streamgate
    print(f"variant {loaded_variant()}; {args.threads} threads; median of {args.reps} alternating calls; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'layer':<8} {'rows':>5} {'block ms':>9} {'oneDNN ms':>9} {'block GF/s':>10} {'oneDNN GF/s':>11} {'oneDNN/block':>12}")
    rows = []
    with torch.inference_mode():
        for n, k, name in (s for s in SHAPES if s[2] in args.layers.split(",")):
            wb = torch.randn(n, k).bfloat16()
            blocks = ops.pack_bf16(wb)
            onednn = torch.ops.mkldnn._reorder_linear_weight(wb, 8)
            for m in (int(r) for r in args.rows.split(",")):
                xb = torch.randn(m, k).bfloat16()
                blk, pk = median_pair_ms(lambda: ops.linear_bf16(xb, blocks, None, n),
                                         lambda: torch.ops.mkldnn._linear_pointwise(xb, onednn, None, "none", [], ""),
                                         args.reps)
                gf = 2 * m * n * k * 1e-6
                print(f"{name:<8} {m:>5} {blk:>9.3f} {pk:>9.3f} {gf / blk:>10.1f} {gf / pk:>11.1f} {pk / blk:>11.2f}x")
                rows.append({"layer": name, "out": n, "in": k, "rows": m, "block_bf16_ms": blk, "onednn_bf16_ms": pk})
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    write_json(args.json_out, prov, args=vars(args), threads=args.threads, variant=loaded_variant(), rows=rows)
    print(f"wrote {args.json_out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=None, help="default 1,2,4,8,32,256 (--crossover: 1,2,4,8,16,32,64,128,512)")
    ap.add_argument("--layers", default=",".join(name for _, _, name in SHAPES), help="which layer shapes, by name")
    ap.add_argument("--crossover", action="store_true", help="only the bf16 block kernel against oneDNN, alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json-out", default="bench/results/gemm.json")
    args = ap.parse_args(argv)
    from bench.provenance import provenance, write_json

    prov = provenance("engine.gemm", argv)
    if args.crossover:
        args.rows = args.rows or "1,2,4,8,16,32,64,128,512"
        return crossover(args, prov)
    args.rows = args.rows or "1,2,4,8,32,256"

    import torch
    import torch.nn.functional as F

    from engine.kernels import load_kernels
    from engine.dtypes import native_bf16_cpu

    torch.set_num_threads(args.threads)
    kernel = load_kernels()
    print(f"native bf16: {native_bf16_cpu()}; oneDNN bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}; "
          f"C++ kernel: {kernel}; {args.threads} threads; ms per call (median of {args.reps})")
    print(f"{'layer':<8} {'rows':>5} {'sg fp32':>9} {'mkl fp32':>9} {'bf16':>9} {'bf16 pk':>9} {'bf16 blk':>9} {'best bf16 / best fp32':>22}")
    ops = torch.ops.streamgate
    rows = []
    with torch.inference_mode():
        for n, k, name in SHAPES:
            w = torch.randn(n, k)
            wb = w.bfloat16()
            packed = ops.pack_linear(w) if kernel else None
            packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(wb, 8)
            blocks = ops.pack_bf16(wb) if kernel else None
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                xb = x.bfloat16()
                sg = median_ms(lambda: ops.linear(x, packed, None, n), args.reps) if kernel else float("nan")
                mkl = median_ms(lambda: F.linear(x, w), args.reps)
                bf = median_ms(lambda: F.linear(xb, wb), args.reps)
                pk = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(xb, packed_bf16, None, "none", [], ""), args.reps)
                blk = median_ms(lambda: ops.linear_bf16(xb, blocks, None, n), args.reps) if kernel else float("nan")
                ratio = min(v for v in (bf, pk, blk) if v == v) / min(v for v in (sg, mkl) if v == v)
                print(f"{name:<8} {m:>5} {sg:>9.3f} {mkl:>9.3f} {bf:>9.3f} {pk:>9.3f} {blk:>9.3f} {ratio:>21.2f}x")
                rows.append({"layer": name, "out": n, "in": k, "rows": m, "kernel_fp32_ms": None if sg != sg else sg,
                             "mkl_fp32_ms": mkl, "torch_bf16_ms": bf, "onednn_bf16_ms": pk,
                             "block_bf16_ms": None if blk != blk else blk})
    write_json(args.json_out, prov, args=vars(args), threads=args.threads, native_bf16=bool(native_bf16_cpu()),
               onednn_bf16=bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), kernel=bool(kernel), rows=rows)
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
