"""`python -m bench.engine.profile_decode --serving`: an eager and a torch.compile'd engine on the
same staggered arrivals, stepping in turn (the host is shared: alternating steps gives both the
same load). One request arrives per step (decode batches of 1..32 beside chunked prefill); each
engine's forward time is summed by step kind (decode-only, with prefill), with the graphs
torch.compile made at start-up and during the run and whether the greedy outputs agree.

Each dtype of `--dtypes` runs in its own process with TORCHINDUCTOR_CACHE_DIR set to a fresh
directory, so every compile time is a cold cache's and no dtype inherits another's graphs or
dynamo counters; the parent writes one JSON with a result per dtype
(bench/renderers/profile.py renders it)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

KINDS = ("decode-only", "with prefill")


def run_serving(args, argv) -> int:
    if args.serving_child:
        return _child(args)
    from bench.provenance import provenance, write_json

    prov = provenance("engine.profile_decode", argv)
    results = []
    for dtype in (args.dtypes or args.dtype).split(","):
        with tempfile.TemporaryDirectory(prefix="profile-serving-") as tmp:
            out, cache = Path(tmp) / "result.json", Path(tmp) / "inductor"
            cmd = [sys.executable, "-m", "bench.engine.profile_decode", "--serving", "--dtype", dtype,
                   "--num-requests", str(args.num_requests), "--max-prompt", str(args.max_prompt),
                   "--max-output", str(args.max_output), "--device", args.device,
                   "--attention-backend", args.attention_backend, "--serving-child", str(out)]
            cmd += ["--threads", args.threads] if args.threads else []
            cmd += ["--model-dir", args.model_dir] if args.model_dir else []
            proc = subprocess.run(cmd, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
            if proc.returncode != 0:
                print(f"--serving: the {dtype} run failed (exit {proc.returncode})", file=sys.stderr)
                return proc.returncode
            results.append(json.loads(out.read_text()))
    loads = [v for r in results for v in r["loadavg"]]
    path = write_json(args.json_out, prov, args={**vars(args), "mode": "serving"}, runs=results,
                      loadavg_range=[min(loads), max(loads)])
    print(f"wrote {path}")
    return 0


def _child(args) -> int:
    """One dtype's run (in the fresh inductor cache the parent set); its result to --serving-child."""
    import torch
    from torch._dynamo.utils import counters

    from engine import EngineConfig, LLMEngine, SamplingParams

    if args.threads:
        torch.set_num_threads(int(args.threads))
    load_start = os.getloadavg()[0]
    cfg = dict(model=args.model_dir or "default", device=args.device, dtype=args.dtype, max_num_seqs=32,
               max_num_batched_tokens=256, attention_backend=args.attention_backend)
    engines = {"eager": LLMEngine(EngineConfig(**cfg))}
    engines["compiled"] = LLMEngine(EngineConfig(**cfg, compile=True))
    startup_graphs = counters["stats"]["unique_graphs"]
    rng = random.Random(0)
    requests = [([rng.randrange(1000, 40000) for _ in range(rng.randint(16, args.max_prompt))],
                 SamplingParams(max_tokens=rng.randint(4, args.max_output), temperature=0.0, ignore_eos=True))
                for _ in range(args.num_requests)]
    outputs = {name: {} for name in engines}
    forward = {name: Counter() for name in engines}
    steps = {name: Counter() for name in engines}
    step = 0
    while step < len(requests) or any(e.has_unfinished() for e in engines.values()):
        for name, eng in engines.items():
            if step < len(requests):
                eng.add_request(f"r{step}", *requests[step])
            if not eng.has_unfinished():
                continue
            decode_only = not eng.scheduler.waiting and all(not s.is_prefill for s in eng.scheduler.running)
            for out in eng.step():
                outputs[name].setdefault(out.request_id, []).extend(out.new_token_ids)
            kind = KINDS[0] if decode_only else KINDS[1]
            forward[name][kind] += eng.runner.last_forward_time
            steps[name][kind] += 1
        step += 1
    same = sum(outputs["eager"][r] == outputs["compiled"][r] for r in outputs["eager"])
    result = {"dtype": str(engines["eager"].runner.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "compile_time_s": engines["compiled"].runner.compile_time_s,
              "forward_s": {name: {k: forward[name][k] for k in KINDS} for name in engines},
              "steps": {name: {k: steps[name][k] for k in KINDS} for name in engines},
              "graphs_startup": startup_graphs,
              "graphs_after_startup": counters["stats"]["unique_graphs"] - startup_graphs,
              "graph_breaks": sum(counters["graph_break"].values()), "engine_steps": step,
              "greedy_equal": same, "requests": len(outputs["eager"]), "inductor_cache": "fresh directory",
              "loadavg": [load_start, os.getloadavg()[0]]}
    for eng in engines.values():
        eng.close()
    print(f"{result['dtype']}: {args.num_requests} requests (prompts 16..{args.max_prompt}, outputs "
          f"4..{args.max_output}), one per step, max 32 running, 256-token steps; compile took "
          f"{result['compile_time_s']:.1f} s")
    for kind in KINDS:
        e, c = forward["eager"][kind], forward["compiled"][kind]
        print(f"  {kind:13s} eager {e:7.2f} s ({steps['eager'][kind]} steps), compiled {c:7.2f} s "
              f"({steps['compiled'][kind]}): compiled/eager {c / e if e else float('nan'):.3f}")
    print(f"  graphs: {startup_graphs} at start-up, {result['graphs_after_startup']} more during {step} steps; "
          f"graph breaks {result['graph_breaks']}; greedy outputs equal for {same}/{result['requests']} requests",
          flush=True)
    Path(args.serving_child).write_text(json.dumps(result))
    return 0
