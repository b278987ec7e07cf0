"""Timed replay of a workload's requests (bench/serving/loadgen.py makes them): open loop on
schedule, closed loop per user, with a time limit and a progress line on stderr."""

from __future__ import annotations

import asyncio
import sys
import time

from bench.serving.loadgen import Req, Workload


def new_record(req: Req) -> dict:
    """What a driver fills in for one request; times are seconds from the run's start."""
    return {"id": req.id, "tenant": req.tenant, "cls": req.cls, "user": req.user, "long": req.long,
            "prompt_words": req.prompt_words, "max_tokens": req.max_tokens, "arrival": req.at, "send": None,
            "end": None, "deltas": [], "output_tokens": None, "prompt_tokens": None, "queue_s": None,
            "finish": None, "error": None, "status": None}


async def replay(reqs: list[Req], wl: Workload, send, *, time_limit: float, label: str = "",
                 t0: float | None = None) -> list[dict]:
    """Send every request on schedule (open loop) or per user (closed loop) with
    `await send(req, record, t0)`; requests still running `time_limit` seconds after t0
    (default: now) are cancelled (`error = "time_limit"`, or `"not_sent"` if never sent)."""
    records = {r.id: new_record(r) for r in reqs}
    t0 = time.perf_counter() if t0 is None else t0

    async def guarded(req: Req) -> None:
        try:
            await send(req, records[req.id], t0)
        except Exception as exc:            # a client-side failure: recorded, not raised
            rec = records[req.id]
            rec["end"], rec["error"] = time.perf_counter() - t0, f"client_error: {type(exc).__name__}: {exc}"

    async def at_time(req: Req) -> None:
        await asyncio.sleep(max(0.0, req.at - (time.perf_counter() - t0)))
        await guarded(req)

    async def user_loop(mine: list[Req]) -> None:
        for req in mine:
            if time.perf_counter() - t0 > wl.duration_s:
                return
            records[req.id]["arrival"] = time.perf_counter() - t0
            await guarded(req)
            await asyncio.sleep(req.think_s)

    if wl.arrival == "closed":
        users = sorted({r.user for r in reqs})
        tasks = [asyncio.ensure_future(user_loop([r for r in reqs if r.user == u])) for u in users]
    else:
        tasks = [asyncio.ensure_future(at_time(r)) for r in reqs]
    progress = asyncio.ensure_future(_progress(list(records.values()), t0, label))
    try:
        left = max(0.0, time_limit - (time.perf_counter() - t0))
        _, pending = await asyncio.wait(tasks, timeout=left) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        progress.cancel()
        await asyncio.gather(progress, return_exceptions=True)
        _print_progress(list(records.values()), t0, label, final=True)
    for rec in records.values():
        if rec["end"] is None and rec["error"] is None:
            rec["error"] = "time_limit" if rec["send"] is not None else "not_sent"
    return list(records.values())


def _print_progress(recs: list[dict], t0: float, label: str, final: bool = False) -> None:
    done = sum(r["end"] is not None or r["error"] is not None for r in recs)
    toks = sum(n for r in recs for _, n in r["deltas"])
    el = time.perf_counter() - t0
    line = (f"[{label or 'serve'}] {done}/{len(recs)} requests done, {el:6.1f} s elapsed, "
            f"{toks} tokens ({toks / el if el > 0 else 0:.1f} tok/s)")
    tty = sys.stderr.isatty()
    print(("\r" + line) if tty else line, end="\n" if final or not tty else "", file=sys.stderr, flush=True)


async def _progress(recs: list[dict], t0: float, label: str) -> None:
    every = 1.0 if sys.stderr.isatty() else 10.0
    while True:
        await asyncio.sleep(every)
        _print_progress(recs, t0, label)
