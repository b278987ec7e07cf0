"""Scheduler benchmarks on SmolLM2 (issue: scheduler under pressure).

    python -m bench.engine.scheduling smoothness   # 16 decoding streams while 4 ~2k-token prompts arrive
    python -m bench.engine.scheduling preemption   # cost of a preemption by context length: recompute vs swap
    python -m bench.engine.scheduling burst        # 32 streams start at once: fixed budget vs ITL targets
    python -m bench.engine.scheduling model        # the same two traces on a cost model (no torch, seconds)

`smoothness` runs the same trace, in-process: chunked prefill with decode first (a fixed
budget of 256, the adaptive budget at `--itl-target-ms`, and the budget the engine measures
at start, `max_num_batched_tokens=None`: engine/budget_probe.py) and prefill-first unchunked
scheduling (the whole prompt in one step, decodes wait). It reports the inter-token
latency of the 16 streams while the long prompts are being prefilled: p50 / p99 / max,
and the time the long prompts took to their first token.

`burst` (issue 14's 32-stream case, in-process): 32 streams in a closed loop, all starting
at once, each sending its next request (256-token prompt, 64 output tokens) when its
answer ends; TTFT p50 / p99, ITL p50 / p99 and output tokens/s, once per `--targets` entry
(`none`: the fixed budget of 512; a number: the adaptive budget at that ITL target).

`model` is not a measurement: it drives the real scheduler and budget with a step time of
a + b·decodes + c·prompt tokens (defaults: DESIGN.md's idle-host probes for SmolLM2 fp32,
60 ms, 5 ms, 2.1 ms) and runs the burst and smoothness traces for each target in seconds,
independent of how busy the host is.

Each writes --json-out (default bench/results/WHICH.json) with its provenance.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.config_cli import add_engine_args


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _engine(args, chunked: bool, budget: int | None, **kw):
    from engine import EngineConfig, LLMEngine
    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_batched_tokens=budget, chunked_prefill=chunked,
                                 max_num_seqs=32, enable_prefix_caching=False, **kw))
    args._engine_dtype = str(eng.runner.dtype).removeprefix("torch.")       # what "auto" became, for the JSON
    return eng


def smoothness(args) -> dict:
    from engine import SamplingParams

    rng = random.Random(args.seed)
    text_ids = list(range(1000, 40000))
    streams = [[rng.choice(text_ids) for _ in range(32)] for _ in range(args.streams)]
    longs = [[rng.choice(text_ids) for _ in range(args.long_tokens)] for _ in range(args.long_prompts)]
    results = {}
    for name, chunked, budget, target in (
            (f"chunked, fixed {args.budget}", True, args.budget, None),
            (f"chunked, target {args.itl_target_ms:g} ms", True, args.budget, args.itl_target_ms),
            ("chunked, measured (auto)", True, None, None),
            ("prefill-first unchunked", False, args.long_tokens + 64, None)):
        eng = _engine(args, chunked, budget, itl_target_ms=target)
        p = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        for i, s in enumerate(streams):
            eng.add_request(f"s{i}", s, p)
        last: dict[str, float] = {}
        gaps: list[float] = []
        long_first: dict[str, float] = {}
        arrived: dict[str, float] = {}
        step = 0
        while len(long_first) < len(longs) or step < args.warmup_steps + 5:
            if step >= args.warmup_steps and (step - args.warmup_steps) % args.arrival_every == 0:
                i = (step - args.warmup_steps) // args.arrival_every
                if i < len(longs):
                    eng.add_request(f"long{i}", longs[i], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
                    arrived[f"long{i}"] = time.perf_counter()
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id.startswith("s") and o.new_token_ids:
                    if o.request_id in last and arrived:       # measure once long prompts arrive
                        gaps.append(now - last[o.request_id])
                    last[o.request_id] = now
                elif o.request_id.startswith("long") and o.new_token_ids and o.request_id not in long_first:
                    long_first[o.request_id] = now - arrived[o.request_id]
            step += 1
        results[name] = {
            "itl_target_ms": target,
            "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p99_ms": 1000 * percentile(gaps, 99),
            "itl_max_ms": 1000 * max(gaps), "itl_samples": len(gaps), "budget": eng.config.max_num_batched_tokens,
            "long_prompt_ttft_s_median": statistics.median(long_first.values()), "long_prompts_served": len(long_first),
        }
        r = results[name]
        print(f"{name:26s} ITL p50 {r['itl_p50_ms']:7.1f} ms  p99 {r['itl_p99_ms']:7.1f} ms  "
              f"max {r['itl_max_ms']:7.1f} ms  p99/p50 {r['itl_p99_ms'] / r['itl_p50_ms']:.2f}  "
              f"long-prompt TTFT median {r['long_prompt_ttft_s_median']:.2f} s  (n={len(gaps)})", flush=True)
    return results


def burst(args) -> dict:
    from engine import SamplingParams

    rng = random.Random(args.seed)
    n = args.burst_streams * args.requests_per_stream
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in range(n)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for spec in args.targets.split(","):
        target = None if spec == "none" else float(spec)
        eng = _engine(args, True, 512, itl_target_ms=target)
        eng.add_request("warmup", prompts[0][:32], SamplingParams(max_tokens=2, temperature=0.0))
        while eng.has_unfinished():
            eng.step()
        arrived, first, last, gaps, budgets = {}, {}, {}, [], []
        queue = list(range(n))

        def send(i: int) -> None:
            eng.add_request(f"r{i}", prompts[i], params)
            arrived[f"r{i}"] = time.perf_counter()

        start = time.perf_counter()
        for _ in range(args.burst_streams):
            send(queue.pop(0))
        tokens = 0
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter()
            budgets.append(eng.stats()["token_budget"])
            for o in outs:
                if o.new_token_ids:
                    tokens += len(o.new_token_ids)
                    if o.request_id in last:
                        gaps.append(now - last[o.request_id])
                    else:
                        first[o.request_id] = now - arrived[o.request_id]
                    last[o.request_id] = now
                if o.finished and queue:
                    send(queue.pop(0))
        elapsed = time.perf_counter() - start
        ttft = list(first.values())
        r = results[spec] = {
            "itl_target_ms": target, "requests": n, "first_tokens": len(first), "output_tokens": tokens,
            "output_tok_s": tokens / elapsed, "elapsed_s": elapsed,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p99_ms": 1000 * percentile(gaps, 99),
            "budget_median": percentile(budgets, 50), "budget_max": max(budgets), "budget_min": min(budgets)}
        print(f"{'fixed 512' if target is None else f'target {target:g} ms':18s} out {r['output_tok_s']:5.1f} tok/s  "
              f"TTFT p50 {r['ttft_p50_s']:5.2f} s p99 {r['ttft_p99_s']:5.2f} s  ITL p50 {r['itl_p50_ms']:6.0f} ms "
              f"p99 {r['itl_p99_ms']:6.0f} ms  budget min/median/max {r['budget_min']}/{r['budget_median']:.0f}/"
              f"{r['budget_max']}", flush=True)
    return results


def model(args) -> dict:
    from engine.block_manager import BlockManager
    from engine.config import EngineConfig, SamplingParams
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    a, b, c = (float(x) for x in args.costs.split(","))
    rng = random.Random(args.seed)

    def run(target, budget, requests, until):
        cfg = EngineConfig(num_kv_blocks=20000, max_num_seqs=32, max_num_batched_tokens=budget, itl_target_ms=target,
                           enable_prefix_caching=False, watermark=0.0)
        clock = [0.0]
        s = Scheduler(cfg, BlockManager(20000, 16, False), clock=lambda: clock[0])
        for d, p in ((0, 64), (4, 0), (8, 256), (16, 0), (32, 128), (2, 512)):    # a server that has been serving
            s.budget.observe(d, p, a + b * d + c * p)
        last, gaps, first, step, measuring = {}, [], {}, 0, False
        while not until(step, first):
            for rid, n, max_tokens in requests(step):
                s.add(Sequence(rid, [rng.randrange(100, 9999) for _ in range(n)], SamplingParams(max_tokens=max_tokens),
                               arrival_time=clock[0]))
                measuring |= rid.startswith("long")              # streams' gaps count from the first long arrival
            out = s.schedule()
            t = a + b * out.num_decode_tokens + c * out.num_prefill_tokens
            clock[0] += t
            s.budget.observe(out.num_decode_tokens, out.num_prefill_tokens, t)
            for q in s.update(out, [7] * len(out.sampling_seqs)):
                if q.request_id in last and q.request_id.startswith("s") and measuring:
                    gaps.append(clock[0] - last[q.request_id])
                first.setdefault(q.request_id, clock[0] - q.arrival_time)
                last[q.request_id] = clock[0]
            step += 1
        return first, gaps

    results = {}
    n = args.burst_streams
    for spec in args.targets.split(","):
        target = None if spec == "none" else float(spec)
        first, _ = run(target, 512, lambda st: [(f"r{i}", args.prompt_tokens, args.output_tokens) for i in range(n)] if st == 0 else [],
                       lambda st, f: len(f) == n)
        ttft = list(first.values())
        longs = lambda st: [(f"s{i}", 32, 10**6) for i in range(args.streams)] if st == 0 else (  # noqa: E731
            [(f"long{(st - 5) // 6}", args.long_tokens, 4)] if st >= 5 and (st - 5) % 6 == 0 and (st - 5) // 6 < args.long_prompts else [])
        first, gaps = run(target, args.budget, longs, lambda st, f: sum(k.startswith("long") for k in f) == args.long_prompts)
        r = results[spec] = {"burst_ttft_p50_s": percentile(ttft, 50), "burst_ttft_p99_s": percentile(ttft, 99),
                             "smooth_itl_p50_ms": 1000 * percentile(gaps, 50),
                             "smooth_itl_p99_ms": 1000 * percentile(gaps, 99)}
        print(f"{'fixed' if target is None else f'target {target:g} ms':18s} burst TTFT p50 {r['burst_ttft_p50_s']:5.1f} s "
              f"p99 {r['burst_ttft_p99_s']:5.1f} s | smoothness ITL p50 {r['smooth_itl_p50_ms']:5.0f} ms "
              f"p99 {r['smooth_itl_p99_ms']:5.0f} ms (p99/p50 {r['smooth_itl_p99_ms'] / r['smooth_itl_p50_ms']:.2f})")
    return results


def preemption(args) -> dict:
    """Time to bring back a context of each `--contexts` length: recompute (prefill it again,
    in chunks of 1,024) vs swap (copy its blocks out to the host pool and back)."""
    import torch

    from engine import SamplingParams
    from engine.scheduler_output import SchedulerOutput

    contexts = [int(n) for n in args.contexts.split(",")]
    eng = _engine(args, True, 1024, num_swap_blocks=max(256, -(-max(contexts) // 8)))
    rng = random.Random(args.seed)
    rows = []
    for n in contexts:
        ctx = [rng.randrange(1000, 40000) for _ in range(n)]
        recompute, swap = [], []
        for i in range(args.repeats):
            eng.add_request(f"p{n}-{i}", ctx, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            t = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            recompute.append(time.perf_counter() - t)
        blocks = list(range(-(-n // eng.config.block_size)))
        for _ in range(args.repeats):
            t = time.perf_counter()
            moved = eng.runner.swap(SchedulerOutput(swap_out=[(b, b) for b in blocks]))
            moved += eng.runner.swap(SchedulerOutput(swap_in=[(b, b) for b in blocks]))
            swap.append(time.perf_counter() - t)
        r = {"context_tokens": n, "recompute_s_median": statistics.median(recompute),
             "swap_out_and_in_s_median": statistics.median(swap), "swap_bytes": moved, "blocks": len(blocks),
             "recompute_s": recompute, "swap_out_and_in_s": swap}
        rows.append(r)
        print(f"{n:,} tokens of context: recompute {r['recompute_s_median'] * 1000:.0f} ms, "
              f"swap out+in {r['swap_out_and_in_s_median'] * 1000:.1f} ms ({moved / 2**20:.1f} MiB moved)", flush=True)
    return {"rows": rows, "block_size": eng.config.block_size, "threads": torch.get_num_threads()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", metavar="which", choices=["smoothness", "preemption", "burst", "model"])
    ap.add_argument("--costs", default="0.060,0.005,0.0021", help="model: a,b,c seconds (step, decode row, prompt token)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--long-prompts", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--arrival-every", type=int, default=6, help="steps between long-prompt arrivals")
    ap.add_argument("--itl-target-ms", type=float, default=2000.0, help="smoothness: the adaptive row's target")
    ap.add_argument("--burst-streams", type=int, default=32)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--targets", default="none,1000,1500,2500", help="burst: 'none' (fixed 512) or ITL targets in ms")
    ap.add_argument("--contexts", default="512,1024,2048", help="preemption: context lengths in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    add_engine_args(ap, only=("model", "dtype"))
    ap.add_argument("--json-out", default=None, help="default: bench/results/WHICH.json")
    args = ap.parse_args(argv)
    from bench.provenance import provenance, write_json

    prov = provenance("engine.scheduling", argv)
    res = {"smoothness": smoothness, "preemption": preemption, "burst": burst, "model": model}[args.mode](args)
    dtype = getattr(args, "_engine_dtype", None)
    write_json(args.json_out or f"bench/results/{args.mode}.json", prov, args=vars(args), dtype=dtype, result=res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
