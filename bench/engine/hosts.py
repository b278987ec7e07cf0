"""The engine's step times as lesser hosts would run them, measured on this one.

    python -m bench.engine.hosts [--hosts amx,avx512_bf16,avx2] [--dtypes bfloat16,float32]
                                 [--rows 1,8,32] [--ctx 300] [--steps 15] [--prefill-reps 5]

Each (host, dtype) runs in its own process, which plays the host with what the engine and its
libraries detect: STREAMGATE_HIDE_CPU_FLAGS (the engine's dtype, kernel variant and linear forms,
engine/dtypes.py), STREAMGATE_KERNEL_ISA (the kernel build), STREAMGATE_AMX=0 (the attention and
int8 tiles), ONEDNN_MAX_CPU_ISA (oneDNN's GEMMs) and, for "avx2", MKL_ENABLE_INSTRUCTIONS (MKL's fp32
GEMM, which bf16's big steps run there: without it MKL kept its AVX-512 code; a 300-token fp32
prefill took 408-424 ms without, 472-478 with it, before the fp32 kernel took every step,
2026-12-07). The CPU's caches, memory and clock stay this
host's, so the figures say what each code path costs here, not what such a CPU would make:
- "amx": this host as it is (an AMX CPU);
- "avx512_bf16": no AMX (a Zen 4 / Zen 5 class host): AVX512-BF16 dot products;
- "avx2": no AVX-512 (a Zen 1 / Haswell class host): bf16 on the block kernel's AVX2 tiles
  (fused_llama.linear_kind; transformers' emulated bf16 before 2026-12-07).
Per process: a `--ctx`-token prompt's prefill step (one chunk, median of `--prefill-reps`) and
the median decode step at each of `--rows` sequences (prompts of `--ctx` tokens, greedy).
Writes --json-out (bench/results/hosts.json); `python -m bench report` renders it (§10).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOSTS = {
    "amx": {},
    "avx512_bf16": {"STREAMGATE_HIDE_CPU_FLAGS": "amx_bf16,amx_tile,amx_int8,amx_fp16", "STREAMGATE_AMX": "0",
                    "STREAMGATE_KERNEL_ISA": "avx512_bf16", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx2": {"STREAMGATE_HIDE_CPU_FLAGS": "amx_bf16,amx_tile,amx_int8,amx_fp16,avx512f,avx512bw,avx512cd,avx512dq,"
             "avx512vl,avx512_bf16,avx512_vnni,avx512_fp16", "STREAMGATE_AMX": "0",
             "STREAMGATE_KERNEL_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def _child(args) -> dict:
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.dtypes import native_bf16_cpu
    from engine.kernels import loaded_variant

    rng = random.Random(0)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    rows = [int(r) for r in args.rows.split(",")]

    def make() -> LLMEngine:
        return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_batched_tokens=max(512, args.ctx),
                                      max_num_seqs=max(rows), enable_prefix_caching=False,
                                      num_kv_blocks=(max(rows) + 1) * (args.ctx + 2 * args.steps + 64) // 16 + 64))

    def prompt() -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(args.ctx)]

    eng = make()
    prefill = []
    for i in range(args.prefill_reps + 1):
        eng.add_request(f"p{i}", prompt(), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        while not any(o.finished for o in eng.step()):
            pass
        prefill.append(time.perf_counter() - t)
    decode = {}
    for n in rows:
        eng = make()
        for i in range(n):
            eng.add_request(f"d{n}-{i}", prompt(), params)
        while eng.scheduler.waiting or any(s.is_prefill for s in eng.scheduler.running):
            eng.step()
        for _ in range(3):
            eng.step()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        decode[n] = round(statistics.median(times) * 1e3, 2)
        del eng
    return {"variant": loaded_variant(), "native_bf16": native_bf16_cpu(), "dtype": args.dtype, "threads": torch.get_num_threads(),
            "onednn": torch.backends.mkldnn.is_available(), "prefill_ms": round(statistics.median(prefill[1:]) * 1e3, 2),
            "decode_ms": decode}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="amx,avx512_bf16,avx2")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--model", default="default")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--ctx", type=int, default=300)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--prefill-reps", type=int, default=5)
    p.add_argument("--json-out", default="bench/results/hosts.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        Path(args.child).write_text(json.dumps(_child(args)))
        return 0
    from bench.provenance import provenance, write_json

    prov = provenance("engine.hosts", sys.argv[1:] if argv is None else argv)
    results = []
    for host in args.hosts.split(","):
        for dtype in args.dtypes.split(","):
            with tempfile.TemporaryDirectory(prefix="hosts-") as tmp:
                out = Path(tmp) / "r.json"
                cmd = [sys.executable, "-m", "bench.engine.hosts", "--child", str(out), "--dtype", dtype,
                       "--model", args.model, "--rows", args.rows, "--ctx", str(args.ctx), "--steps", str(args.steps),
                       "--prefill-reps", str(args.prefill_reps)]
                print(f"== {host} {dtype}", file=sys.stderr, flush=True)
                subprocess.run(cmd, env={**os.environ, **HOSTS[host]}, check=True)
                r = json.loads(out.read_text())
            results.append({"host": host, "env": HOSTS[host], **r})
            print(json.dumps(results[-1]), flush=True)
    write_json(args.json_out, prov, results=results,
               args={"ctx": args.ctx, "rows": args.rows, "steps": args.steps, "prefill_reps": args.prefill_reps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
