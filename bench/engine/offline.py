"""Offline throughput benchmark: all requests submitted at once, run to completion.

    python -m bench.engine.offline                                  # 64 requests, all systems
    python -m bench.engine.offline --num-requests 8 --max-prompt 128 --max-output 32   # smoke run

Systems: `engine` (streamgate's LLMEngine), `hf-static` (HF `generate` in padded batches of
8) and `hf-cb` (HF's continuous batching, the manager behind `generate_batch`). Each system
runs in its own subprocess so its peak RSS is its own and a crash cannot stop the others.
Every request decodes greedily for exactly its own output length; throughput counts only
those useful tokens. The engine and HF CB get the same KV budget (`--kv-tokens`) and step
token budget. Results go to stdout (a table) and to --json-out with their provenance (`--roofline
PATH`, a roofline JSON of this host, lets the report state the engine's share of the bound). On a 2-core CPU the full
run takes about an hour (static batching alone 15-30 min); other load skews it, so each
row shows the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path

from bench.workload import make_workload, summarize
from engine.config_cli import add_engine_args

SYSTEMS = ("engine", "hf-static", "hf-cb")
BLOCK_SIZE = 16  # engine KV block size (tokens)
BATCH32 = (24, 40)  # sequences-per-step window for "overhead at batch 32"
TARGETS = {"vs_static": 3.0, "vs_hf_cb": 1.2, "overhead_b32": 0.10, "kv_waste": 0.04}


def _model_dir(name: str, model_dir: str | None = None) -> str:
    """Local directory of the model: `--model-dir` if given, else the engine's resolver."""
    if model_dir:
        return model_dir
    try:
        from engine.models import resolve_model
    except ImportError as e:
        raise SystemExit(f"engine.models.resolve_model unavailable ({e}); pass --model-dir") from e
    return str(resolve_model(name))


def _rss_mib() -> float:
    """Current resident set size of this process in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_engine(model_dir: str, requests, kv_tokens: int, max_num_seqs: int, max_batched_tokens: int,
               device: str = "cpu", dtype: str = "float32", attention_backend: str = "auto",
               compile: bool = False, cuda_graphs: bool = True) -> dict:
    """Drive `LLMEngine.step()` over all requests, recording the engine's per-step stats."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    cfg = EngineConfig(model=model_dir, device=device, dtype=dtype, block_size=BLOCK_SIZE,
                       num_kv_blocks=kv_tokens // BLOCK_SIZE, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_batched_tokens, attention_backend=attention_backend,
                       compile=compile, cuda_graphs=cuda_graphs)
    eng = LLMEngine(cfg)
    rss_loaded = _rss_mib()
    eng.add_request("warmup", prompt_token_ids=list(requests[0].prompt_ids[:8]),
                    params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    outputs = {r.request_id: [] for r in requests}
    reasons, steps, stats_s = {}, [], 0.0
    start = time.perf_counter()
    for r in requests:
        eng.add_request(r.request_id, prompt_token_ids=list(r.prompt_ids),
                        params=SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        s = eng.stats()
        stats_s += time.perf_counter() - t1
        for o in outs:
            outputs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
                if len(reasons) % 8 == 0:
                    print(f"engine: {len(reasons)}/{len(requests)} requests, {time.perf_counter() - start:.0f} s",
                          file=sys.stderr, flush=True)
        batch = next((s[k] for k in ("num_seqs_scheduled", "num_running", "running") if s.get(k) is not None), None)
        steps.append({"wall": t1 - t0, "forward": s.get("forward_time_s"),
                      "running": batch, "blocks_used": s.get("kv_blocks_used"),
                      "blocks_total": s.get("kv_blocks_total"), "slots_used": s.get("kv_slots_used")})
    wall = time.perf_counter() - start - stats_s
    bad = {k: v for k, v in reasons.items() if v != "length"}
    notes = [f"attention {'kernel' if eng.runner.use_kernel else 'torch'}, {eng.runner.dtype}, "
             f"{f'compiled in {eng.runner.compile_time_s:.0f} s' if compile else 'eager'}, "
             f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_batched_tokens}, "
             f"KV {cfg.num_kv_blocks} x {cfg.block_size}-token blocks"]
    return {
        "dtype": str(eng.runner.dtype).removeprefix("torch."),
        "wall_s": wall,
        "output_tokens": sum(len(v) for v in outputs.values()),
        "generated_tokens": sum(len(v) for v in outputs.values()),
        "num_steps": len(steps),
        "steps": steps,
        **_step_metrics(steps, eng.stats().get("block_size", cfg.block_size)),
        "rss_after_load_mib": rss_loaded,
        "outputs": outputs,
        "notes": notes + ([f"finish reasons other than length: {bad}"] if bad else []),
    }


def _step_metrics(steps: list[dict], block_size: int) -> dict:
    """Overhead (share of `step()` wall time outside the model forward) and KV waste at peak block use."""
    def overhead(rows):
        rows = [r for r in rows if r["forward"] is not None]
        total = sum(r["wall"] for r in rows)
        return (1 - sum(r["forward"] for r in rows) / total) if rows and total > 0 else None

    lo, hi = BATCH32
    b32 = [r for r in steps if r["running"] is not None and lo <= r["running"] <= hi]
    peak = max((r for r in steps if r["blocks_used"]), key=lambda r: r["blocks_used"], default=None)
    waste = None
    if peak and peak["slots_used"] is not None:
        waste = 1 - peak["slots_used"] / (peak["blocks_used"] * block_size)
    return {
        "overhead": overhead(steps),
        "overhead_b32": overhead(b32),
        "b32_steps": len(b32),
        "max_running": max((r["running"] for r in steps if r["running"] is not None), default=None),
        "kv_waste_at_peak": waste,
        "kv_peak_blocks": peak and peak["blocks_used"],
        "kv_total_blocks": peak and peak["blocks_total"],
        "stats_missing": sorted(k for k in ("forward", "running", "blocks_used", "slots_used")
                                if steps and all(r[k] is None for r in steps)),
    }


def run_system(args) -> dict:
    """Run one system in this process; the result includes its peak RSS."""
    import torch
    from transformers import AutoTokenizer

    from bench.engine import baselines

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    model_dir = _model_dir(args.model, args.model_dir)
    requests = _workload(AutoTokenizer.from_pretrained(model_dir), args)
    if args.system == "engine":
        result = run_engine(model_dir, requests, args.kv_tokens, args.max_num_seqs, args.max_batched_tokens,
                            args.device, args.dtype, args.attention_backend, args.compile, args.cuda_graphs)
    elif args.device != "cpu":
        raise SystemExit(f"{args.system} runs on the CPU only; use --systems engine with --device {args.device}")
    else:
        model = baselines.load_hf_model(model_dir, args.dtype)
        rss_loaded = _rss_mib()
        if args.system == "hf-static":
            result = baselines.run_hf_static(model, requests, batch_size=8)
        else:
            result = baselines.run_hf_cb(model, requests, args.kv_tokens, max_batch_tokens=args.max_batched_tokens,
                                         max_seqs=args.max_num_seqs)
        result["rss_after_load_mib"] = rss_loaded
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["tok_per_s"] = result["output_tokens"] / result["wall_s"]
    result["loadavg_1m"] = [load_before, os.getloadavg()[0]]  # other work on the machine skews timings
    return result


def _workload(tokenizer, args) -> list:
    """The benchmark's requests, as the command-line flags define them."""
    return make_workload(tokenizer, num_requests=args.num_requests, seed=args.seed,
                         min_prompt=min(16, args.max_prompt), max_prompt=args.max_prompt,
                         min_output=min(16, args.max_output), max_output=args.max_output)


def _spawn(system: str, args, tmp: Path) -> dict:
    """Run one system in a child process and read back its JSON result (or its failure)."""
    out = tmp / f"{system}.json"
    cmd = [sys.executable, "-m", "bench.engine.offline", "--system", system, "--json-out", str(out)]
    for flag in ("num_requests", "seed", "max_prompt", "max_output", "threads", "model", "model_dir",
                 "max_num_seqs", "max_batched_tokens", "kv_tokens", "device", "dtype", "attention_backend"):
        if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    cmd += [flag for flag, on in (("--compile", args.compile), ("--no-cuda-graphs", not args.cuda_graphs)) if on]
    print(f"== {system} ...", file=sys.stderr, flush=True)
    rc = subprocess.run(cmd).returncode
    if out.exists():
        return json.loads(out.read_text())
    return {"error": f"exit code {rc}"}


def _agreement(results: dict, k: int = 16) -> None:
    """Share of requests whose first k greedy tokens match the reference (hf-static if it ran)."""
    ref = next((results[s]["outputs"] for s in ("hf-static", "hf-cb", "engine") if s in results), None)
    for res in results.values():
        if ref is not None:
            same = sum(res["outputs"].get(rid, [])[:k] == toks[:k] for rid, toks in ref.items())
            res["agree_first16"] = same / len(ref)
        res.pop("outputs", None)


def _report(results: dict, workload: dict, targets: dict) -> list[str]:
    """The human-readable summary, as lines."""
    fmt = lambda v, spec, width=0: ("-" if v is None else format(v, spec)).rjust(width)  # noqa: E731
    tps = {s: r.get("tok_per_s") for s, r in results.items()}
    lines = [f"workload: {workload['num_requests']} requests, {workload['prompt_tokens']} prompt tokens, "
             f"{workload['output_tokens']} output tokens (prompt {workload['prompt_len_range']}, "
             f"output {workload['output_len_range']})", "",
             f"{'system':<10} {'wall s':>8} {'out tok/s':>10} {'vs static':>9} {'vs hf-cb':>8} "
             f"{'peak RSS MiB':>12} {'agree16':>7}  notes"]
    for s, r in results.items():
        if "error" in r:
            lines.append(f"{s:<10} failed: {r['error']}")
            continue
        vs = lambda b: tps[s] / tps[b] if tps.get(b) else None  # noqa: E731
        lines.append(f"{s:<10} {r['wall_s']:>8.1f} {r['tok_per_s']:>10.1f} {fmt(vs('hf-static'), '.2f', 9)} "
                     f"{fmt(vs('hf-cb'), '.2f', 8)} {r['peak_rss_mib']:>12.0f} {fmt(r.get('agree_first16'), '.0%', 7)}"
                     f"  load {r['loadavg_1m'][0]:.1f}->{r['loadavg_1m'][1]:.1f}; {'; '.join(r['notes'])}")
    e = results.get("engine", {})
    if "overhead" in e:
        lines += ["", f"engine: {e['num_steps']} steps, max running {fmt(e['max_running'], 'd')}; "
                  f"overhead {fmt(e['overhead'], '.1%')} overall, {fmt(e['overhead_b32'], '.1%')} at "
                  f"{BATCH32[0]}-{BATCH32[1]} running ({e['b32_steps']} steps); KV waste at peak "
                  f"{fmt(e['kv_waste_at_peak'], '.2%')} ({fmt(e['kv_peak_blocks'], 'd')}/"
                  f"{fmt(e['kv_total_blocks'], 'd')} blocks)"]
        if e["stats_missing"]:
            lines.append(f"engine.stats() lacked: {', '.join(e['stats_missing'])}")
    verdicts = {None: "not measured", True: "met", False: "NOT met"}
    lines += [""] + [f"target {k}: {fmt(t['value'], '.3g')} (target {t['target']}) {verdicts[t['met']]}"
                     for k, t in targets.items()]
    return lines


def _targets(results: dict) -> dict:
    """Each target's measured value and whether it is met (None when not measured)."""
    e, tps = results.get("engine", {}), {s: r.get("tok_per_s") for s, r in results.items()}
    ratio = lambda b: tps["engine"] / tps[b] if tps.get("engine") and tps.get(b) else None  # noqa: E731
    measured = {"vs_static": ratio("hf-static"), "vs_hf_cb": ratio("hf-cb"),
                "overhead_b32": e.get("overhead_b32"), "kv_waste": e.get("kv_waste_at_peak")}
    return {k: {"value": v, "target": TARGETS[k],
                "met": None if v is None else (v >= TARGETS[k] if k.startswith("vs") else v <= TARGETS[k])}
            for k, v in measured.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in each system")
    add_engine_args(p, only=("model", "device", "dtype", "attention_backend", "compile", "cuda_graphs", "max_num_seqs"))
    p.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step (engine and HF CB)")
    p.add_argument("--kv-tokens", type=int, default=24576, help="KV cache capacity in tokens (engine and HF CB)")
    p.add_argument("--model-dir", help="local HF model directory (skips resolve_model)")
    p.add_argument("--json-out", default="bench/results/offline.json")
    p.add_argument("--roofline", help="a roofline JSON of this host and model (bench.engine.roofline): the "
                   "engine's tok/s as a fraction of the workload's bound")
    p.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)  # child mode: run one system
    args = p.parse_args(argv)

    if args.system:
        try:
            result = run_system(args)
        except Exception as e:  # reported by the parent as "failed: ..."
            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {e}"}
        Path(args.json_out).write_text(json.dumps(result))     # the parent's temporary file, not a published run
        return 0

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems: {', '.join(sorted(unknown))}")
    from transformers import AutoTokenizer

    from bench.engine.roofline import load_roofline
    from bench.provenance import provenance, write_json

    prov = provenance("engine.offline", argv)
    model_dir = args.model_dir = _model_dir(args.model, args.model_dir)  # children skip resolving
    roof = load_roofline(args.roofline, model_dir) if args.roofline else None
    workload = summarize(_workload(AutoTokenizer.from_pretrained(model_dir), args))
    with tempfile.TemporaryDirectory() as tmp:
        results = {s: _spawn(s, args, Path(tmp)) for s in systems}
    _agreement({s: r for s, r in results.items() if "error" not in r})
    targets = _targets(results)
    print("\n".join(_report(results, workload, targets)))
    write_json(args.json_out, prov, args=vars(args), workload=workload, model_dir=model_dir, systems=results,
               targets=targets, roofline=roof,
               env={"python": platform.python_version(), "threads": args.threads, "torch": version("torch"),
                    "transformers": version("transformers")})
    print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
