"""Serving benchmark: replay a workload file against streamgate and report latency,
throughput, goodput and per-tenant service (issue 6).

    python -m bench.serving.serve --workload mixed                        # start a server, drive it over WS
    python -m bench.serving.serve --workload mixed --compare static,continuous,chunked
    python -m bench.serving.serve --workload mixed --rates 0.25,0.5,1,2   # one run per offered rate
    python -m bench.serving.serve --workload two_tenants --compare fcfs,fair
    python -m bench.serving.serve --workload two_tenants --only-tenant polite      # its unloaded baseline
    python -m bench.serving.serve --workload mixed --driver inprocess --offline    # engine, all requests at once
    python -m bench.serving.serve --workload mixed --driver hf                     # HF continuous batching, offline
    python -m bench.serving.serve --workload mixed --url http://host:8000 --api-key sg-...   # a running server

Workloads are TOML files in bench/serving/workloads/ (format: bench/serving/loadgen.py). By default each
run starts its own `python -m gateway.cli serve` on 127.0.0.1 with a generated tenants
file; `--url` drives any server instead (the only way to reach beyond loopback). Presets
for `--compare`: static (--batching static), continuous (--no-chunked-prefill, prefill
first; its budget is raised to 2048 so a whole long prompt fits one step), chunked (the
default: decode first, chunked prefill), fcfs / priority / fair / cost (--policy X), or
NAME=FLAGS ("swap=--preemption-mode swap --num-swap-blocks 256"). Flags are applied in
this order: the workload's server_args, the preset's, then --engine-args. Every run
(preset x rate) gets a fresh server, so no prefix cache or counter carries over; a server
given with --url keeps its prefix cache between runs (a sweep repeats the same prompts).
Each run is bounded by the workload's request count and --time-limit (the HF baseline
only by the request count).

Output: a progress line on stderr, a table on stdout, JSON with its provenance (--json-out,
default bench/results/serve-<workload>.json; docs/BENCHMARKS.md renders it with
bench/renderers/serving.py) and PNG plots (--plots-dir). Each delta counts one
token unless the server sends `num_tokens` with it (see drivers.py). Per tenant, the
weighted service as the fair policy counts it, while every tenant is backlogged, by the
server's own counters and by the client's records (bench/serving/weighted.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench import server
from bench.provenance import provenance, write_json
from bench.serving import servestats, weighted
from bench.serving.drivers import InprocDriver, SseDriver, WsDriver, run_hf_offline
from bench.serving.loadgen import Req, WorkloadError, load_workload, make_requests
from bench.serving.replay import new_record, replay
from engine.config_cli import add_engine_args

PRESETS = {
    "static": ["--batching", "static"],
    "continuous": ["--no-chunked-prefill", "--max-num-batched-tokens", "2048"],
    "chunked": [],
    "fcfs": ["--policy", "fcfs"], "priority": ["--policy", "priority"],
    "fair": ["--policy", "fair"], "cost": ["--policy", "cost"],
}


def parse_presets(spec: str | None) -> list[tuple[str, list[str]]]:
    """`--compare` entries as (name, flags); None gives one run with no preset flags."""
    if not spec:
        return [("run", [])]
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, eq, flags = item.partition("=")
        if eq:
            out.append((name, shlex.split(flags)))
        elif name in PRESETS:
            out.append((name, PRESETS[name]))
        else:
            raise SystemExit(f"--compare: unknown preset {name!r} (known: {', '.join(PRESETS)}, or NAME=FLAGS)")
    return out


# -- a server of our own --------------------------------------------------------------------------
def write_tenants(wl, path: Path) -> dict[str, str]:
    """A tenants file with a fresh key per workload tenant (no quotas); returns the keys."""
    from tenants import hash_key, new_key

    keys, lines = {}, []
    for t in wl.tenants:
        keys[t.name] = new_key()
        lines += [f"[tenants.{t.name}]", f'api_key_sha256 = ["{hash_key(keys[t.name])}"]',
                  f"priority = {t.priority}", f"weight = {t.weight}"]
        lines += [f"deadline_ms = {t.deadline_ms}"] if t.deadline_ms else []
    path.write_text("\n".join(lines) + "\n")
    return keys


def start_server(model: str, flags: list[str], wl, tmp: Path, timeout_s: float = 300.0):
    """A fresh `streamgate serve` for one run; returns (process, url, keys)."""
    keys = write_tenants(wl, tmp / "tenants.toml")
    log = tmp / f"server-{time.monotonic_ns()}.log"
    proc, url = server.launch(["--model", model, "--tenants", str(tmp / "tenants.toml"),
                               "--ledger", str(tmp / "usage.sqlite3"), "--drain-grace", "2", *flags],
                              log, timeout_s=timeout_s)
    return proc, url, keys


stop_server = server.stop


def engine_config(model: str, flags: list[str]):
    """EngineConfig from `streamgate serve` engine flags (for --driver inprocess)."""
    from engine.config_cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser(prog="engine flags")
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(["--model", model, *flags]))


# -- one run ----------------------------------------------------------------------------------------
async def drive(driver, reqs: list[Req], wl, time_limit: float, label: str,
                served: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """Open the driver, warm up with one short request, replay, sample stats meanwhile
    (and the per-tenant served-token counters into `served`, if given)."""
    await driver.open(reqs)
    try:
        t = wl.tenants[0]
        warm = Req(f"warmup-{os.getpid()}-{time.monotonic_ns()}", t.name, "warmup", 0.0, None, 0.0,
                   [{"role": "user", "content": "Hello, how are you today?"}], 5, 4, t.priority, t.weight)
        rec = new_record(warm)
        await asyncio.wait_for(driver.send(warm, rec, time.perf_counter()), timeout=min(120.0, time_limit))
        if rec["error"] is not None:
            raise RuntimeError(f"the warm-up request failed: {rec['error']}")
        samples: list[dict] = []
        t0 = time.perf_counter()
        sampler = asyncio.ensure_future(driver.sample_stats(samples, t0))
        try:
            async with weighted.ServedSampler(driver, served if served is not None else [], t0):
                recs = await replay(reqs, wl, driver.send, time_limit=time_limit, label=label, t0=t0)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        return recs, samples
    finally:
        await driver.close()


def run_once(args, wl, reqs: list[Req], preset: str, flags: list[str], label: str) -> dict:
    flags = shlex.split(wl.server_args) + flags + shlex.split(args.engine_args)
    run = {"label": label, "preset": preset, "flags": flags, "rate": wl.rate, "driver": args.driver}
    if args.driver == "hf":
        from engine.models import resolve_model

        res = run_hf_offline(str(resolve_model(args.model)), reqs, args.kv_tokens, 512, 64)
        n, wall = len(reqs), res["wall_s"]
        run["summary"] = {"requests": n, "ok": n, "failed": 0, "failures": {}, "makespan_s": wall,
                          "output_tokens": res["output_tokens"], "throughput_rps": n / wall,
                          "output_tps": res["output_tokens"] / wall, "notes": res["notes"]}
        return {**run, "requests": [], "stats": []}
    served: list[dict] = []
    if args.driver == "inprocess":
        recs, samples = asyncio.run(drive(InprocDriver(engine_config(args.model, flags)), reqs, wl,
                                          args.time_limit, label, served))
    else:
        transport = WsDriver if args.driver == "ws" else SseDriver
        if args.url:
            keys = {t.name: t.api_key or args.api_key for t in wl.tenants}
            if not all(keys.values()):
                raise SystemExit("--url needs an api_key per tenant in the workload file, or --api-key")
            recs, samples = asyncio.run(drive(transport(args.url.rstrip("/"), keys), reqs, wl, args.time_limit, label,
                                              served))
        else:
            with tempfile.TemporaryDirectory(prefix="streamgate-bench-") as tmp:
                proc, url, keys = start_server(args.model, flags, wl, Path(tmp))
                try:
                    recs, samples = asyncio.run(drive(transport(url, keys), reqs, wl, args.time_limit, label, served))
                finally:
                    stop_server(proc)
    run["summary"] = servestats.summarize(recs, samples, wl.slo_ttft_ms, wl.slo_tpot_ms)
    run["summary"]["weighted_service"] = weighted.weighted_service(recs, {t.name: t.weight for t in wl.tenants},
                                                                   served)
    return {**run, "requests": recs, "stats": samples, "served": served}


# -- report -------------------------------------------------------------------------------------------
def verdicts(runs: list[dict], ttft_line_ms: float = 2000.0) -> list[str]:
    """The issue's targets, where the runs measure them."""
    by = {r["label"]: r["summary"] for r in runs}
    lines = []
    if by.get("static", {}).get("output_tps") and "continuous" in by:
        x = by["continuous"]["output_tps"] / by["static"]["output_tps"]
        lines.append(f"continuous / static output tokens/s: {x:.2f}x (target >= 2x)")
    ratios = [f"{r['label']} {d['p99'] / d['p50']:.2f}" for r in runs
              if (d := r["summary"].get("itl_long_prefill_ms", {})).get("p50")]
    if ratios:
        lines.append("ITL p99 / p50 while long prompts prefill: " + ", ".join(ratios) + " (target for chunked <= 2)")
    for preset in dict.fromkeys(r["preset"] for r in runs if r["rate"] is not None and r["requests"]):
        mine = sorted((r for r in runs if r["preset"] == preset), key=lambda r: r["rate"])
        if len(mine) > 1:
            over = next((r["rate"] for r in mine if (r["summary"]["ttft_ms"]["p99"] or 0) > ttft_line_ms), None)
            lines.append(f"{preset}: TTFT p99 first exceeds {ttft_line_ms / 1000:g} s at "
                         + ("none of the rates" if over is None else f"{over:g} req/s"))
    return lines


def write_plots(runs: list[dict], plots_dir: Path, tag: str, sweep: bool) -> list[Path]:
    from bench.serving import plots

    timed = [r for r in runs if r["requests"]]
    safe = lambda s: re.sub(r"[^A-Za-z0-9_.@-]+", "_", s)  # noqa: E731
    out = [plots.latency_cdfs(timed, plots_dir / f"{tag}-latency_cdf.png")] if timed else []
    for r in timed:
        out.append(plots.itl_over_time(r, plots_dir / f"{tag}-{safe(r['label'])}-itl_time.png"))
        out.append(plots.tenant_tokens(r, plots_dir / f"{tag}-{safe(r['label'])}-tenant_tokens.png"))
    if sweep and timed:
        out.append(plots.rate_sweep(timed, plots_dir / f"{tag}-rate_sweep.png", ttft_line_s=2.0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="streamgate bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mixed", help="name in bench/serving/workloads/ or a TOML path")
    p.add_argument("--driver", default="ws", choices=["ws", "sse", "inprocess", "hf"])
    p.add_argument("--url", default=None, help="drive this running server instead of starting one")
    p.add_argument("--api-key", default=None, help="with --url: key for tenants without api_key")
    add_engine_args(p, only=("model",))
    p.add_argument("--compare", default=None, help="presets, e.g. static,continuous,chunked or fcfs,fair")
    p.add_argument("--engine-args", default="", help="extra `streamgate serve` engine flags for every run")
    p.add_argument("--rate", type=float, default=None, help="total request rate (scales every tenant's)")
    p.add_argument("--rates", default=None, help="comma-separated rates: one run per rate (a sweep)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="bound on the arrival window (s)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--only-tenant", default=None, help="send only this tenant's requests (same arrivals)")
    p.add_argument("--offline", action="store_true", help="every request arrives at t=0")
    p.add_argument("--time-limit", type=float, default=600.0, help="per run; unfinished requests are cancelled")
    p.add_argument("--kv-tokens", type=int, default=24576, help="--driver hf: KV cache size in tokens")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plots-dir", default="bench/results/plots")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    prov = provenance("serving.serve", argv)

    if args.driver == "hf" and (args.compare or args.rates):
        p.error("--driver hf runs HF's continuous batching offline: no --compare or --rates")
    if args.url and args.driver in ("inprocess", "hf"):
        p.error(f"--url drives a server over ws or sse, not --driver {args.driver}")
    try:
        wl = load_workload(args.workload)
    except WorkloadError as exc:
        p.error(str(exc))
    over = {k: v for k, v in (("num_requests", args.num_requests), ("duration_s", args.duration),
                              ("seed", args.seed)) if v is not None}
    wl = replace(wl, **over)
    if args.rate is not None:
        wl = wl.with_rate(args.rate)
    rates = [float(x) for x in args.rates.split(",")] if args.rates else [None]
    if wl.arrival == "closed" and (args.rates or args.rate):
        raise SystemExit("--rate/--rates apply to poisson workloads; this one is a closed loop")
    if args.only_tenant and args.only_tenant not in {t.name for t in wl.tenants}:
        raise SystemExit(f"--only-tenant: no tenant {args.only_tenant!r} in workload {wl.name!r}")
    tag = wl.name + (f"-only-{args.only_tenant}" if args.only_tenant else "") + (
        "-hf" if args.driver == "hf" else "-offline" if args.offline else "")
    runs = []
    for preset, flags in parse_presets(args.compare):
        for rate in rates:
            w = wl.with_rate(rate) if rate is not None else wl
            reqs = [r for r in make_requests(w, offline=args.offline or args.driver == "hf")
                    if args.only_tenant in (None, r.tenant)]
            name = preset if args.compare else ("hf-cb" if args.driver == "hf" else args.driver)
            label = name + (f"@{rate:g}/s" if rate is not None else "")
            print(f"== {label}: {len(reqs)} requests of workload {w.name!r} via {args.driver}", file=sys.stderr,
                  flush=True)
            runs.append(run_once(args, w, reqs, preset, flags, label))
    print(f"workload {wl.name} ({wl.arrival}), driver {args.driver}, model {args.model}; "
          f"SLO TTFT {wl.slo_ttft_ms:g} ms, TPOT {wl.slo_tpot_ms:g} ms")
    print("\n".join(servestats.format_table(runs) + verdicts(runs)))
    public = replace(wl, tenants=tuple(replace(t, api_key=None) for t in wl.tenants))    # no keys in results
    out = write_json(args.json_out or f"bench/results/serve-{tag}.json", prov, workload=asdict(public),
                     args={**vars(args), "api_key": None}, cpus=os.cpu_count(), runs=runs)
    print(f"wrote {out}")
    if not args.no_plots:
        for path in write_plots(runs, Path(args.plots_dir), tag, sweep=len(rates) > 1):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
