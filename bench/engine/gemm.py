"""SmolLM2's linear layers alone, in every form the engine can run them, side by side.

    python -m bench.engine.gemm [--rows 1,2,4,8,32,256] [--threads 2] [--reps 50] [--json-out bench/results/gemm.json]

For each layer shape (fused q/k/v, o, fused gate/up, down, lm_head) and row count: the C++
kernel on fp32 weights packed for it (`streamgate::linear`), MKL's fp32 `F.linear`, torch's
bf16 `F.linear` and oneDNN's bf16 matmul on weights prepacked for it (what the fused Llama
forward runs in bf16). Median of --reps calls each, the forms alternating per shape. Where
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,32,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json-out", default="bench/results/gemm.json")
    args = ap.parse_args(argv)
    from bench.provenance import provenance, write_json

    prov = provenance("engine.gemm", argv)

    import torch
    import torch.nn.functional as F

    from engine.kernels import load_kernels
    from engine.dtypes import native_bf16_cpu

    torch.set_num_threads(args.threads)
    kernel = load_kernels()
    print(f"native bf16: {native_bf16_cpu()}; oneDNN bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}; "
          f"C++ kernel: {kernel}; {args.threads} threads; ms per call (median of {args.reps})")
    print(f"{'layer':<8} {'rows':>5} {'sg fp32':>9} {'mkl fp32':>9} {'bf16':>9} {'bf16 pk':>9} {'best bf16 / best fp32':>22}")
    ops = torch.ops.streamgate
    rows = []
    with torch.inference_mode():
        for n, k, name in SHAPES:
            w = torch.randn(n, k)
            wb = w.bfloat16()
            packed = ops.pack_linear(w) if kernel else None
            packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(wb, 8)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                xb = x.bfloat16()
                sg = median_ms(lambda: ops.linear(x, packed, None, n), args.reps) if kernel else float("nan")
                mkl = median_ms(lambda: F.linear(x, w), args.reps)
                bf = median_ms(lambda: F.linear(xb, wb), args.reps)
                pk = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(xb, packed_bf16, None, "none", [], ""), args.reps)
                ratio = min(bf, pk) / min(v for v in (sg, mkl) if v == v)
                print(f"{name:<8} {m:>5} {sg:>9.3f} {mkl:>9.3f} {bf:>9.3f} {pk:>9.3f} {ratio:>21.2f}x")
                rows.append({"layer": name, "out": n, "in": k, "rows": m, "kernel_fp32_ms": None if sg != sg else sg,
                             "mkl_fp32_ms": mkl, "torch_bf16_ms": bf, "onednn_bf16_ms": pk})
    write_json(args.json_out, prov, args=vars(args), threads=args.threads, native_bf16=bool(native_bf16_cpu()),
               onednn_bf16=bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), kernel=bool(kernel), rows=rows)
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
