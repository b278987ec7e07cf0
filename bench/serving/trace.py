"""Where a tenant's time to first token goes: a serving workload replayed in-process with
every engine step recorded (issue 11's "understand it with a trace").

    python -m bench.serving.trace --workload two_tenants --tenant polite --compare 'fair,fcfs'
    python -m bench.serving.trace --workload priority --tenant interactive --compare priority --slowest 8

For each of the tenant's slowest requests (by TTFT) it splits the time from arrival to
the first token into: waiting (in the queue, no seat) and prefill (from the step that
first scheduled it to the one that sampled its first token: how many steps, the chunk
sizes, the step times, how many preemptions it took). The same workload file, seed and
flags as `bench.serving.serve`, with `--driver inprocess` (no gateway, no HTTP): the numbers are the
engine's own. The full per-step log goes to --json-out.

`--costs a,b,c` replays the same requests on the real `Scheduler` with a fake clock and a
step time of a + b·decodes + c·prompt tokens instead (no model, seconds per run, immune
to a shared host): not a measurement, a way to see what the scheduler does with this
arrival pattern. Prompt lengths come from the model's tokenizer and chat template. It
also replays `--tenant` alone, for the unloaded baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.serving.drivers import InprocDriver
from bench.serving.loadgen import load_workload, make_requests
from bench.serving.serve import drive, engine_config, parse_presets
from bench.serving.servestats import percentile
from bench.serving.weighted import describe, weighted_service
from engine.config_cli import add_engine_args


class TracingDriver(InprocDriver):
    """The in-process driver, with each `LLMEngine.step()` recorded: when it started, how
    long it took, what it ran (request, tokens, decode or not) and who was preempted."""

    def __init__(self, config):
        super().__init__(config)
        self.steps: list[dict] = []
        self.t0 = time.perf_counter()

    async def open(self, reqs) -> None:
        await super().open(reqs)
        engine = self.eng.engine
        run_step = engine.step

        def step():
            start = time.perf_counter()
            outs = run_step()
            b = engine.scheduler.last_output
            self.steps.append({"t": start - self.t0, "dur": time.perf_counter() - start,
                               "entries": [(s.request_id, n, d) for s, n, d in zip(b.seqs, b.num_new_tokens, b.is_decode)],
                               "preempted": [s.request_id for s in b.preempted],
                               "waiting": len(engine.scheduler.waiting), "budget": b.token_budget})
            return outs

        engine.step = step                 # the engine thread looks the method up every step

    async def send(self, req, rec: dict, t0: float) -> None:
        self.t0 = t0
        await super().send(req, rec, t0)


def breakdown(rec: dict, steps: list[dict], own: set[str]) -> dict | None:
    """Arrival → first scheduled → first token for one request, from the step log, and how
    many of its tenant's (`own`) requests were running in the step it arrived in."""
    if rec["send"] is None or not rec["deltas"]:
        return None
    mine = [(s, n, d) for s in steps for rid, n, d in s["entries"] if rid == rec["id"]]
    if not mine:
        return None
    first = mine[0][0]
    at = next((s for s in steps if s["t"] >= rec["send"]), first)
    prefill = [(s, n) for s, n, d in mine if not d and s["t"] < rec["deltas"][0][0]]
    last = prefill[-1][0] if prefill else first
    return {"id": rec["id"], "ttft": rec["deltas"][0][0] - rec["send"],
            "wait": first["t"] - rec["send"], "prefill": last["t"] + last["dur"] - first["t"],
            "prefill_steps": len({id(s) for s, _ in prefill}), "chunks": [n for _, n in prefill],
            "step_s": [round(s["dur"], 3) for s, _ in prefill],
            "preempted": sum(rec["id"] in s["preempted"] for s in steps),
            "waiting_at_arrival": at["waiting"], "own_running": len({rid for rid, _, _ in at["entries"]} & own)}


def report(label: str, recs: list[dict], steps: list[dict], tenant: str, slowest: int) -> dict:
    own = {r["id"] for r in recs if r["tenant"] == tenant}
    rows = [b for r in recs if r["tenant"] == tenant and (b := breakdown(r, steps, own))]
    rows.sort(key=lambda b: b["ttft"], reverse=True)
    durs = [s["dur"] for s in steps]
    ttft = [b["ttft"] for b in rows]
    print(f"== {label}: {tenant} TTFT p50 {percentile(ttft, 50):.2f} s p99 {percentile(ttft, 99):.2f} s "
          f"({len(rows)} requests); step time p50 {percentile(durs, 50) * 1000:.0f} ms "
          f"p99 {percentile(durs, 99) * 1000:.0f} ms over {len(steps)} steps")
    for b in rows[:slowest]:
        print(f"  {b['id']:>14s} TTFT {b['ttft']:6.2f} s = waiting {b['wait']:6.2f} s + prefill {b['prefill']:5.2f} s "
              f"({b['prefill_steps']} steps, chunks {b['chunks']}, step s {b['step_s']}); "
              f"at arrival {b['own_running']} of its own running, {b['waiting_at_arrival']} queued; "
              f"preempted {b['preempted']}x")
    return {"label": label, "rows": rows}


def replay_model(reqs, prompts: dict[str, list[int]], config, costs, wl) -> tuple[list[dict], list[dict], dict]:
    """The requests on the real scheduler, stepped on a fake clock (see the module doc):
    records shaped like loadgen's, a step log shaped like the traced run's, and the run's
    totals. Open loop: each request arrives at its time. Closed loop (`r.at` is None): a
    user's next request arrives when its previous one ends plus its think time, while the
    clock is within the workload's duration, as `replay.replay` sends them."""
    from engine.block_manager import BlockManager
    from engine.config import SamplingParams
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    a, b, c = costs
    clock = [0.0]
    s = Scheduler(config, BlockManager(4096, config.block_size, config.enable_prefix_caching), clock=lambda: clock[0])
    closed = wl.arrival == "closed"
    queues = {u: [r for r in reqs if r.user == u] for u in dict.fromkeys(r.user for r in reqs)} if closed else {}
    pending = [(0.0, q.pop(0)) for q in queues.values() if q] if closed else [(r.at, r) for r in reqs]
    pending.sort(key=lambda p: p[0])
    recs, steps, seqs = {}, [], {}
    while pending or s.has_unfinished():
        if not s.has_unfinished() and pending[0][0] > clock[0]:
            clock[0] = pending[0][0]
        while pending and pending[0][0] <= clock[0]:
            at, r = pending.pop(0)
            seqs[r.id] = Sequence(r.id, prompts[r.id], SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                  priority=r.priority, tenant=r.tenant, weight=r.weight, arrival_time=at)
            s.add(seqs[r.id])
            recs[r.id] = {"id": r.id, "tenant": r.tenant, "user": r.user, "send": at, "end": None, "deltas": [],
                          "prompt_tokens": len(prompts[r.id])}
        out = s.schedule()
        t = a + b * out.num_decode_tokens + c * out.num_prefill_tokens
        steps.append({"t": clock[0], "dur": t, "preempted": [q.request_id for q in out.preempted],
                      "entries": [(q.request_id, n, d) for q, n, d in zip(out.seqs, out.num_new_tokens, out.is_decode)],
                      "waiting": len(s.waiting), "budget": out.token_budget})
        clock[0] += t
        s.budget.observe(out.num_decode_tokens, out.num_prefill_tokens, t)
        for q in s.update(out, [7] * len(out.sampling_seqs)):
            rec = recs[q.request_id]
            rec["deltas"].append([clock[0], 1])
            if q.status.finished:
                rec["end"] = clock[0]
                mine = queues.get(rec["user"])
                if mine and clock[0] + mine[0].think_s <= wl.duration_s:
                    pending.append((clock[0] + mine[0].think_s, mine.pop(0)))
                    pending.sort(key=lambda p: p[0])
    tokens = sum(len(r["deltas"]) for r in recs.values())
    return list(recs.values()), steps, {"output_tps": tokens / clock[0], "seat_preemptions": s.counters.seat_preemptions,
                                        "preemptions_per_request": s.counters.preemptions / max(1, len(recs)),
                                        "max_preemptions": max((q.num_preemptions for q in seqs.values()), default=0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.serving.trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="two_tenants")
    p.add_argument("--tenant", default="polite", help="whose requests to break down")
    p.add_argument("--compare", default="fair", help="presets as in bench.serving.serve")
    add_engine_args(p, only=("model",))
    p.add_argument("--engine-args", default="")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None)
    p.add_argument("--slowest", type=int, default=6)
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--costs", default=None, help="a,b,c: replay on the cost model instead (seconds)")
    p.add_argument("--seeds", type=int, default=0,
                   help="with --costs: replay seeds 1..N of the workload and summarize each preset's "
                        "--tenant TTFT p99 / p90 as multiples of the tenant alone (one p99 of a dozen "
                        "requests is its slowest one)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    wl = load_workload(args.workload)
    wl = replace(wl, **{k: v for k, v in (("num_requests", args.num_requests), ("duration_s", args.duration))
                        if v is not None})
    reqs = make_requests(wl)
    if args.costs:
        return model_seeds(args, wl) if args.seeds else model_main(args, wl, reqs)
    out = []
    for preset, flags in parse_presets(args.compare):
        flags = shlex.split(wl.server_args) + flags + shlex.split(args.engine_args)
        driver = TracingDriver(engine_config(args.model, flags))
        print(f"== {preset}: {len(reqs)} requests of {wl.name!r}, flags {' '.join(flags)}", file=sys.stderr, flush=True)
        recs, _ = asyncio.run(drive(driver, reqs, wl, args.time_limit, preset))
        out.append({**report(preset, recs, driver.steps, args.tenant, args.slowest), "steps": driver.steps})
    path = Path(args.json_out or f"bench/results/trace-{wl.name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    print(f"wrote {path}")
    return 0


def chat_prompts(tok, reqs) -> dict[str, list[int]]:
    """Each request's prompt as the model sees it: its messages through the chat template."""
    return {r.id: list(tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]) for r in reqs}


def model_config(args, wl, flags: list[str]):
    """The engine config of one preset: the workload's server flags, the preset's, then --engine-args."""
    return engine_config(args.model, shlex.split(wl.server_args) + flags + shlex.split(args.engine_args))


def model_main(args, wl, reqs) -> int:
    from transformers import AutoTokenizer

    from engine.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    prompts = chat_prompts(tok, reqs)
    costs = tuple(float(x) for x in args.costs.split(","))
    runs = [(preset, flags, reqs) for preset, flags in parse_presets(args.compare)]
    runs.append((f"{args.tenant}-alone", [], [r for r in reqs if r.tenant == args.tenant]))
    for label, flags, mine in runs:
        recs, steps, tot = replay_model(mine, prompts, model_config(args, wl, flags), costs, wl)
        report(label, recs, steps, args.tenant, args.slowest)
        ws = weighted_service(recs, {t.name: t.weight for t in wl.tenants})
        print(f"   {tot['output_tps']:.1f} out tok/s, {tot['preemptions_per_request']:.2f} preemptions/request "
              f"({tot['seat_preemptions']} for seats, at most {tot['max_preemptions']} for one); weighted service "
              f"(VTC, every tenant backlogged): {describe(ws)}; "
              + ", ".join(f"{k} {v['service']:.0f}" for k, v in ws["client"]["tenants"].items()), flush=True)
    return 0


def model_seeds(args, wl) -> int:
    from statistics import mean

    from transformers import AutoTokenizer

    from engine.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    costs = tuple(float(x) for x in args.costs.split(","))
    presets = parse_presets(args.compare)
    rows: dict[str, list[tuple]] = {label: [] for label, _ in presets}
    for seed in range(1, args.seeds + 1):
        w = replace(wl, seed=seed)
        reqs = make_requests(w)
        prompts = chat_prompts(tok, reqs)

        def ttfts(mine, flags):
            recs, _, tot = replay_model(mine, prompts, model_config(args, w, flags), costs, w)
            return [r["deltas"][0][0] - r["send"] for r in recs if r["tenant"] == args.tenant and r["deltas"]], tot

        alone, _ = ttfts([r for r in reqs if r.tenant == args.tenant], [])
        for label, flags in presets:
            t, tot = ttfts(reqs, flags)
            rows[label].append((percentile(t, 99) / percentile(alone, 99), percentile(t, 90) / percentile(alone, 90),
                                tot["output_tps"], tot["preemptions_per_request"]))
    print(f"{args.tenant} TTFT as a multiple of its unloaded value, seeds 1..{args.seeds}, costs {args.costs}")
    for label, r in rows.items():
        p99 = [x[0] for x in r]
        print(f"  {label:>14s}: p99 x{mean(p99):.2f} mean, x{max(p99):.2f} max [{' '.join(f'{x:.1f}' for x in p99)}]; "
              f"p90 x{mean(x[1] for x in r):.2f} mean; {mean(x[2] for x in r):.1f} out tok/s; "
              f"{mean(x[3] for x in r):.2f} preemptions/request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
