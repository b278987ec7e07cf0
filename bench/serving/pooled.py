"""One tenant's TTFT under load against its unloaded value, pooled over several seeds of a
workload (issue 11's p99 targets, measured on enough requests to mean a p99).

    python -m bench.serving.pooled --workload two_tenants --tenant polite --seeds 1-5 --compare fair
    python -m bench.serving.pooled --workload priority --tenant interactive --seeds 1-5 \\
        --compare 'priority,prio-noiso=--policy priority --no-isolate-prompts'

A single `bench.serving.serve` run of `two_tenants` sends the polite tenant about a dozen requests,
so its "p99" is its slowest request, and how slow that one is depends mostly on where
the seed put the tenant's bursts. Here each seed's arrivals are replayed against a fresh
server once with the tenant alone (its unloaded baseline) and once per preset, one after
another per seed (so a slow spell of a shared host hits every system), and the tenant's
TTFTs are pooled per system over all seeds. It reports the pooled p50 / p90 / p99 as
multiples of the pooled unloaded ones, each system's output tokens/s (mean over seeds)
and preemptions per request, and each seed's own p99 multiple beside them.
Presets and flags are `bench.serving.serve`'s; JSON with every record goes to --json-out.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from bench.provenance import provenance, write_json
from bench.serving.loadgen import load_workload, make_requests
from bench.serving.serve import parse_presets, run_once
from bench.serving.servestats import percentile, request_metrics
from engine.config_cli import add_engine_args

QS = (50, 90, 99)


def seed_list(spec: str) -> list[int]:
    """'1-5' or '1,3,7' → seeds."""
    if "-" in spec:
        lo, hi = (int(x) for x in spec.split("-", 1))
        return list(range(lo, hi + 1))
    return [int(x) for x in spec.split(",")]


def ttfts(run: dict, tenant: str) -> list[float]:
    """The tenant's TTFTs (s) in one run; a request with no first token counts as infinite,
    so a failure can only make the pooled numbers worse."""
    out = []
    for rec in run["requests"]:
        if rec["tenant"] == tenant:
            t = request_metrics(rec)["ttft"]
            out.append(t if t is not None else float("inf"))
    return out


def totals(runs: list[dict]) -> tuple[float, float]:
    """Output tokens/s (mean over the runs) and seat or KV preemptions per request (all runs)."""
    tps = sum(r["summary"]["output_tps"] for r in runs) / len(runs)
    preempted = sum(r["stats"][-1]["num_preemptions"] for r in runs if r["stats"])
    return tps, preempted / max(1, sum(len(r["requests"]) for r in runs))


def summary(pooled: dict[str, list[float]], per_seed: dict[str, list[float]], runs: list[dict],
            alone: str) -> list[dict]:
    """One row per system (the tenant alone first): requests, pooled TTFT p50/p90/p99 (s) and
    their multiples of alone's, output tokens/s, preemptions per request, each seed's p99
    multiple. What the table prints and the JSON keeps for `streamgate-bench report`."""
    base = {q: percentile(pooled[alone], q) for q in QS}
    rows = []
    for label, xs in pooled.items():
        tps, pre = totals([r for r in runs if r["label"] == label])
        rows.append({"system": label, "requests": len(xs), **{f"p{q}_s": percentile(xs, q) for q in QS},
                     **{f"p{q}_x": percentile(xs, q) / base[q] for q in QS},
                     "output_tps": tps, "preemptions_per_request": pre, "per_seed_p99_x": per_seed[label]})
    return rows


def summarize(rows: list[dict]) -> list[str]:
    lines = [f"{'system':>14s}  n    " + "  ".join(f"p{q} s (x alone)" for q in QS)
             + "  out tok/s  preempt/req  per-seed p99 x alone"]
    for r in rows:
        cells = "  ".join(f"{r[f'p{q}_s']:5.2f} (x{r[f'p{q}_x']:.2f})" for q in QS)
        seeds = " ".join(f"{x:.2f}" for x in r["per_seed_p99_x"])
        lines.append(f"{r['system']:>14s} {r['requests']:3d}  {cells}  {r['output_tps']:9.1f}  "
                     f"{r['preemptions_per_request']:11.2f}  [{seeds}]")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.serving.pooled", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="two_tenants")
    p.add_argument("--tenant", default="polite", help="whose TTFT is measured, loaded and alone")
    p.add_argument("--seeds", default="1-5", help="'1-5' or '1,3,7'")
    p.add_argument("--compare", default="fair", help="presets as in bench.serving.serve")
    p.add_argument("--driver", default="ws", choices=["ws", "sse", "inprocess"])
    add_engine_args(p, only=("model",))
    p.add_argument("--engine-args", default="")
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    prov = provenance("serving.pooled", argv)
    args.url, args.kv_tokens = None, 0                       # what run_once reads besides these
    wl = load_workload(args.workload)
    if args.tenant not in {t.name for t in wl.tenants}:
        raise SystemExit(f"--tenant: no tenant {args.tenant!r} in workload {wl.name!r}")
    presets = parse_presets(args.compare)
    alone = f"{args.tenant}-alone"
    pooled: dict[str, list[float]] = {alone: [], **{label: [] for label, _ in presets}}
    per_seed: dict[str, list[float]] = {label: [] for label in pooled}
    runs = []
    for seed in seed_list(args.seeds):
        w = replace(wl, seed=seed)
        reqs = make_requests(w)
        mine = [r for r in reqs if r.tenant == args.tenant]
        p99 = {}
        for label, flags, sent in [(alone, [], mine)] + [(lbl, f, reqs) for lbl, f in presets]:
            print(f"== seed {seed}, {label}: {len(sent)} requests", file=sys.stderr, flush=True)
            run = {**run_once(args, w, sent, label, flags, label), "seed": seed}
            runs.append(run)
            xs = ttfts(run, args.tenant)
            pooled[label] += xs
            p99[label] = percentile(xs, 99)
        for label in pooled:                                 # this seed's p99 as a multiple of alone's
            per_seed[label].append(p99[label] / p99[alone])
    print(f"{args.tenant} TTFT in workload {wl.name}, seeds {args.seeds}, pooled over every seed")
    rows = summary(pooled, per_seed, runs, alone)
    print("\n".join(summarize(rows)))
    out = write_json(args.json_out or f"bench/results/pooled-{wl.name}.json", prov, args=vars(args),
                     workload=wl.name, summary=rows, runs=runs, pooled=pooled)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
