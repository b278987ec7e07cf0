"""`python -m bench.engine.profile_decode --forwards`: decode steps (no profiler) of the three CPU
forward paths, engines stepping in turn at each thread count in turn, so that every path and
thread count sees the same load: transformers' forward on torch's linears (packed_linear off:
MKL in fp32, oneDNN in bf16), transformers' forward on the packed linear kernel (fused_layers
off; fp32 only: the kernel packs fp32 linears, so in bf16 it would be the torch path again), and
the default fused Llama forward. For each batch size in `--seqs` (decoding sequences
of random context in [min-ctx, max-ctx]) and each of `--threads`: the median whole engine step
of `--steps`. The engines' adaptive thread choice is off, so a step runs on the count given.
Writes JSON (bench/renderers/profile.py renders it)."""

from __future__ import annotations

import os
import random
import statistics
import time

PATHS = {"fused": ("fused Llama forward (default)", {}),
         "packed": ("transformers + packed linears", dict(fused_layers=False)),
         "torch": ("transformers + torch linears", dict(packed_linear=False))}


def run_forwards(args, argv, threads: list[int]) -> int:
    import torch

    from bench.provenance import provenance, write_json
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.dtypes import resolve_dtype
    from engine.kernels import loaded_variant

    prov = provenance("engine.profile_decode", argv)
    resolved = resolve_dtype(args.dtype, torch.device(args.device))
    paths = {key: path for key, path in PATHS.items() if key != "packed" or resolved == torch.float32}
    rows, loads, dtype = [], [os.getloadavg()[0]], None
    for n in (int(x) for x in args.seqs.split(",")):
        tokens = args.max_ctx + len(threads) * args.steps + 16
        engines = {key: LLMEngine(EngineConfig(model=args.model_dir or "default", device=args.device,
                                               dtype=args.dtype, max_num_batched_tokens=2048, max_num_seqs=max(64, n),
                                               enable_prefix_caching=False, num_kv_blocks=n * tokens // 16 + 8,
                                               attention_backend=args.attention_backend, adaptive_threads=False,
                                               **cfg))
                   for key, (_, cfg) in paths.items()}
        dtype = str(engines["fused"].runner.dtype).removeprefix("torch.")
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(args.min_ctx, args.max_ctx))]
                   for _ in range(n)]
        times = {(key, t): [] for key in engines for t in threads}
        for eng in engines.values():
            for i, prompt in enumerate(prompts):
                eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=len(threads) * args.steps + 4,
                                                                temperature=0.0, ignore_eos=True))
            while eng.stats()["waiting"] or any(s.is_prefill for s in eng.scheduler.running):
                eng.step()
            eng.step()                                               # one warm decode step
        loads.append(os.getloadavg()[0])
        for _ in range(args.steps):
            for t in threads:
                torch.set_num_threads(t)
                for key, eng in engines.items():
                    start = time.perf_counter()
                    eng.step()
                    times[key, t].append(time.perf_counter() - start)
        loads.append(os.getloadavg()[0])
        for t in threads:
            fused = statistics.median(times["fused", t])
            for key, (label, _) in paths.items():
                med = statistics.median(times[key, t])
                rows.append({"rows": n, "threads": t, "path": key, "median_s": med, "times_s": times[key, t]})
                print(f"{n:3d} rows {t:2d} threads  {label:30s} {med * 1000:7.1f} ms  "
                      f"{n / med:7.1f} tok/s  {med / fused:5.2f}x the fused step", flush=True)
        for eng in engines.values():
            eng.close()
        del engines
    path = write_json(args.json_out, prov, args={**vars(args), "mode": "forwards"}, dtype=dtype,
                      kernels=loaded_variant(), paths={key: label for key, (label, _) in paths.items()},
                      rows=rows, loadavg_range=[min(loads), max(loads)])
    print(f"wrote {path}")
    return 0
