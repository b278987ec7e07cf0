"""Gateway overhead: one request trace driven in-process through `AsyncEngine`, then through
the gateway over SSE and over WebSocket (a `streamgate serve` subprocess on loopback).

    python -m bench.serving.gateway_overhead [--requests 64] [--rate 4] [--max-tokens 96] [--idle 16]
                                     [--redis [URL]] [--repeats N]

Every request decodes greedily for exactly its max_tokens (`ignore_eos`), so each mode does
the same work. Reported per mode: output tokens/s over the trace's makespan, TTFT
p50/p99 under the trace, and TTFT p50 of `--idle` sequential one-token requests on an idle
engine (the gateway's own added latency, without queueing). Targets (issue 4): ≤ 5 % fewer
tokens/s and ≤ 5 ms more p50 TTFT through the gateway. With `--redis`, each gateway mode
runs twice, with the embedded quota backend and then with Redis (`serve --redis`; a local
redis-server with AOF everysec unless a URL is given), as modes `sse` and `sse+redis` etc.
The tenant has limits too high to refuse anything, so that every check runs (issue 12's
target: no throughput loss beyond noise with Redis). `--repeats N` runs the gateway modes N
times in turn (sse, sse+redis, ws, ws+redis, sse, ...): "runs" in the JSON keeps every run,
"results" the median one by tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import server
from bench.provenance import provenance, write_json
from bench.workload import _text
from engine.config_cli import add_engine_args

MODES = ("inprocess", "sse", "ws")


def make_trace(n: int, rate: float, max_tokens: int, seed: int) -> list[dict]:
    """n chat requests: prompts of 20–300 words, outputs of max_tokens/4..max_tokens, Poisson arrivals."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for i in range(n):
        trace.append({"id": f"r{i}", "at": t, "messages": [{"role": "user", "content": _text(rng, rng.randint(20, 300))}],
                      "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens)})
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return trace


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by this process, or by process `pid`."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _replay(trace: list[dict], one, server_pid: int | None = None) -> dict:
    """Start each request at its arrival time; `one(req)` returns (ttft_s, n_tokens).
    Also records the CPU seconds this (client) process and the server used meanwhile."""
    start = time.perf_counter()
    cpu0, srv0 = _cpu_s(), (_cpu_s(server_pid) if server_pid else None)

    async def timed(req):
        await asyncio.sleep(max(0.0, req["at"] - (time.perf_counter() - start)))
        return await one(req)

    results = await asyncio.gather(*(timed(r) for r in trace))
    wall = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    out = {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
           "ttft_p50_ms": pct(ttfts, 0.5) * 1000, "ttft_p99_ms": pct(ttfts, 0.99) * 1000,
           "client_cpu_s": _cpu_s() - cpu0}
    if server_pid:
        out["server_cpu_s"] = _cpu_s(server_pid) - srv0
    return out


async def _idle(n: int, one) -> float:
    req = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    ttfts = [(await one({**req, "id": f"idle{i}"}))[0] for i in range(n)]
    return statistics.median(ttfts) * 1000


# -- in-process -----------------------------------------------------------------------------------
async def run_inprocess(args, trace) -> dict:
    from engine import AsyncEngine, EngineConfig, SamplingParams

    eng = AsyncEngine(EngineConfig(model=args.model))
    await eng.start()
    tok = eng.tokenizer

    def ids(messages):
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    async def one(req):
        prompt = ids(req["messages"])
        t0, first, n = time.perf_counter(), None, 0
        params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, ignore_eos=True)
        async for out in eng.generate(req["id"], prompt, params):
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            n += len(out.new_token_ids)
        return first - t0, n

    try:
        await _idle(2, one)                     # warm-up
        result = await _replay(trace, one)
        result["idle_ttft_p50_ms"] = await _idle(args.idle, one)
    finally:
        await eng.stop()
    return result


# -- through the gateway --------------------------------------------------------------------------
async def run_sse(args, trace, url: str, key: str, pid: int | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as client:
        async def one(req):
            body = {"messages": req["messages"], "max_tokens": req["max_tokens"], "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            t0, first, n = time.perf_counter(), None, 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = first or time.perf_counter()
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
            return first - t0, n

        await _idle(2, one)
        result = await _replay(trace, one, pid)
        result["idle_ttft_p50_ms"] = await _idle(args.idle, one)
    return result


async def run_ws(args, trace, url: str, key: str, pid: int | None = None, sockets: int = 4) -> dict:
    """Requests are spread over a few sockets (the gateway runs at most 32 per socket)."""
    import websockets

    waiters: dict[str, asyncio.Queue] = {}
    conns = [await websockets.connect(url.replace("http", "ws") + "/v1/chat/ws", max_size=None,
                                      additional_headers={"Authorization": f"Bearer {key}"})
             for _ in range(sockets)]

    async def reader(ws):
        await ws.recv()                          # auth.ok
        async for frame in ws:
            msg = json.loads(frame)
            if msg.get("id") in waiters:
                waiters[msg["id"]].put_nowait(msg)

    readers = [asyncio.ensure_future(reader(ws)) for ws in conns]
    count = 0

    async def one(req):
        nonlocal count
        ws = conns[count % sockets]
        count += 1
        q = waiters[req["id"]] = asyncio.Queue()
        t0, first = time.perf_counter(), None
        await ws.send(json.dumps({"type": "chat.request", "id": req["id"], "messages": req["messages"],
                                  "max_tokens": req["max_tokens"], "temperature": 0, "ignore_eos": True}))
        while True:
            msg = await q.get()
            if msg["type"] == "chat.delta":
                first = first or time.perf_counter()
            elif msg["type"] == "chat.done":
                return first - t0, msg["usage"]["completion_tokens"]
            else:
                raise RuntimeError(f"request {req['id']} failed: {msg}")

    try:
        await _idle(2, one)
        result = await _replay(trace, one, pid)
        result["idle_ttft_p50_ms"] = await _idle(args.idle, one)
    finally:
        for task in readers:
            task.cancel()
        for ws in conns:
            await ws.close()
    return result


LIMITS = ("requests_per_minute = 1000000000\ntokens_per_minute = 1000000000000\n"
          "max_concurrent = 1000000\ndaily_tokens = 1000000000000000\n")


def start_server(args, tmp: Path, redis_url: str | None = None) -> tuple[subprocess.Popen, str, str]:
    from tenants import hash_key, new_key

    key = new_key()
    (tmp / "tenants.toml").write_text(f'[tenants.bench]\napi_key_sha256 = ["{hash_key(key)}"]\n{LIMITS}')
    flags = ["--model", args.model, "--tenants", str(tmp / "tenants.toml"), "--ledger", str(tmp / "usage.sqlite3")]
    proc, url = server.launch(flags + (["--redis", redis_url] if redis_url else []), tmp / "server.log")
    return proc, url, key


@contextlib.contextmanager
def _redis(url: str | None, tmp: Path):
    """The Redis URL to use: None (no Redis runs), the one given, or a local redis-server."""
    if url != "local":
        yield url
        return
    from bench.redis_server import RedisServer

    (tmp / "redis").mkdir()
    redis_server = RedisServer(tmp / "redis", appendfsync="everysec")
    redis_server.start()
    try:
        yield redis_server.url
    finally:
        redis_server.stop()


def report(results: dict) -> list[str]:
    first = next(iter(results))                 # in-process when it ran
    base = results[first]
    lines = [f"{'mode':10} {'tok/s':>8} {'vs ' + first:>14} {'TTFT p50':>10} {'TTFT p99':>10} {'idle TTFT p50':>14} "
             f"{'added':>8} {'client CPU':>11} {'server CPU':>11}"]
    for mode, r in results.items():
        ratio = r["tokens_per_s"] / base["tokens_per_s"] - 1
        added = r["idle_ttft_p50_ms"] - base["idle_ttft_p50_ms"]
        lines.append(f"{mode:10} {r['tokens_per_s']:8.1f} {ratio:+13.1%} {r['ttft_p50_ms']:8.0f}ms {r['ttft_p99_ms']:8.0f}ms "
                     f"{r['idle_ttft_p50_ms']:12.1f}ms {added:+7.1f}ms {r['client_cpu_s']:10.1f}s "
                     f"{r.get('server_cpu_s', float('nan')):10.1f}s")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, only=("model",))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--idle", type=int, default=16, help="sequential 1-token requests for the idle TTFT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--redis", nargs="?", const="local", default=None, metavar="URL",
                   help="also run each gateway mode with the Redis quota backend (default: a local redis-server)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each gateway mode, interleaved; results: the median run (the lower middle one for an even count)")
    p.add_argument("--json-out", default="bench/results/gateway_overhead.json")
    args = p.parse_args(argv)
    prov = provenance("serving.gateway_overhead", argv)
    if args.model == "default":
        from engine.models import resolve_model
        args.model = resolve_model("default")
    trace = make_trace(args.requests, args.rate, args.max_tokens, args.seed)
    modes = [m for m in args.modes.split(",") if m]
    results = {}
    if "inprocess" in modes:
        results["inprocess"] = asyncio.run(run_inprocess(args, trace))
        print(f"inprocess: {results['inprocess']['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, _redis(args.redis, Path(tmp)) as redis_url:
        for i, mode in ((i, m) for i in range(args.repeats) for m in ("sse", "ws") if m in modes):
            for name, backend_url in ((mode, None), (f"{mode}+redis", redis_url)):
                if name.endswith("+redis") and redis_url is None:
                    continue
                run_dir = Path(tmp) / f"{name}-{i}"             # a fresh server per run: same cold state
                run_dir.mkdir()
                proc, url, key = start_server(args, run_dir, backend_url)
                try:
                    runner = run_sse if mode == "sse" else run_ws
                    runs.setdefault(name, []).append(asyncio.run(runner(args, trace, url, key, proc.pid)))
                    print(f"{name}: {runs[name][-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
                finally:
                    server.stop(proc)
    for name, rs in runs.items():               # each gateway mode's median run by tokens/s
        results[name] = sorted(rs, key=lambda r: r["tokens_per_s"])[(len(rs) - 1) // 2]
    if results:
        print("\n".join(report(results)))
    print(f"wrote {write_json(args.json_out, prov, args=vars(args), results=results, runs=runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
