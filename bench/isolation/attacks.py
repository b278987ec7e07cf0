"""The attacks of `bench.isolation`, each run in a process of its own so that the client
work an attack needs (a thousand handshakes, three hundred streams) never delays the
timestamps taken on tenant B's stream.

    python -m bench.isolation.attacks NAME '{"url": "http://127.0.0.1:PORT", "key": "sg-...", ...}'

Prints JSON lines on stdout: `{"start": t}` when it begins sending, `{"ready": t}` once the
attack is in place (sockets open, streams held, request sent), then `{"result": {...}}`.
Times are `time.monotonic()`, which every process on the machine shares. Whatever the
server answers (a status, an error event, a close code, a dropped connection) is part of
the result; nothing the server does makes an attack raise. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import json
import resource
import sys
import time

from bench.isolation.attacks_more import MORE
from bench.isolation.client import MiB, connect, connect_counted, error_code, raw_post, request_outcomes, send_all
from bench.workload import _WORDS

TEXT = (" ".join(_WORDS) + " ") * 8          # ordinary English words: they tokenize like a real prompt


def emit(**msg) -> None:
    print(json.dumps(msg), flush=True)


def ready() -> None:
    """The attack is in place: the parent probes B's WebSocket now."""
    emit(ready=time.monotonic())


def words(n_bytes: int) -> str:
    """About n_bytes of prompt text made of plain words (ASCII, so bytes = characters)."""
    reps = n_bytes // len(TEXT) + 1
    return (TEXT * reps)[:n_bytes]


def _describe_http(r: dict) -> str:
    if r["status"] is None:
        return r.get("error", "no answer")
    code = f" {r['code']}" if r["code"] else ""
    return f"{r['status']}{code} after {r['answered_s']:.2f} s (sent {r['body_sent_mib']:g} MiB)"


# -- the attacks ------------------------------------------------------------------------------------
async def big_prompt(p: dict) -> dict:
    """One HTTP chat request whose prompt is ~prompt_mb MB of text."""
    body = json.dumps({"messages": [{"role": "user", "content": words(int(p["prompt_mb"] * 1e6))}],
                       "max_tokens": 1}).encode()
    emit(start=time.monotonic())
    r = await raw_post(p["url"], p["key"], [body[i:i + MiB] for i in range(0, len(body), MiB)],
                       length=len(body), timeout_s=p["timeout_s"], on_sent=ready)
    return {**r, "outcome": _describe_http(r)}


async def big_frames(p: dict) -> dict:
    """`frames` chat.request frames of ~frame_kib KiB each, back to back on one socket."""
    text = words(p["frame_kib"] * 1024 - 200)
    frames = {f"big{i}": json.dumps({"type": "chat.request", "id": f"big{i}", "max_tokens": 1,
                                     "messages": [{"role": "user", "content": text}]}) for i in range(p["frames"])}
    ws = await connect(p["url"], p["key"])
    try:
        emit(start=time.monotonic())
        code = await send_all(ws, frames.values())
        ready()
        got, closed = await request_outcomes(ws, set(frames), p["timeout_s"]) if code is None else ({}, code)
        code = code or closed
    finally:
        await ws.close()
    answers = collections.Counter(got.values())
    outcome = ", ".join(f"{k}×{n}" for k, n in answers.items()) or "no answer"
    if code is not None:
        outcome += f"; closed {code}"
    return {"answers": got, "close_code": code, "outcome": outcome}


async def stats_flood(p: dict) -> dict:
    """`streams` GET /v1/stats?interval_ms=100 streams held open for hold_s, read as they come."""
    import httpx

    statuses: collections.Counter = collections.Counter()
    received = [0]
    limits = httpx.Limits(max_connections=p["streams"] + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=p["url"], limits=limits, timeout=httpx.Timeout(30.0),
                                 headers={"Authorization": f"Bearer {p['key']}"}) as client:
        async def one() -> httpx.Response | None:
            try:
                r = await client.send(client.build_request("GET", "/v1/stats", params={"interval_ms": 100}),
                                      stream=True)
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
                return None
            if r.status_code != 200:
                statuses[f"{r.status_code} {error_code(await r.aread()) or ''}".strip()] += 1
                await r.aclose()
                return None
            statuses["200"] += 1
            return r

        async def drain(r: httpx.Response) -> None:
            async for chunk in r.aiter_raw():
                received[0] += len(chunk)

        emit(start=time.monotonic())
        responses = [r for r in await asyncio.gather(*(one() for _ in range(p["streams"]))) if r]
        ready()
        readers = [asyncio.ensure_future(drain(r)) for r in responses]
        await asyncio.sleep(p["hold_s"])
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await asyncio.gather(*(r.aclose() for r in responses), return_exceptions=True)
    return {"statuses": dict(statuses), "received_mib": round(received[0] / MiB, 2),
            "outcome": ", ".join(f"{k}×{n}" for k, n in statuses.most_common())}


async def keyless_ws(p: dict) -> dict:
    """`sockets` WebSockets opened with no key that never send anything, held for hold_s."""
    opened, failed, closed_at = [], collections.Counter(), {}
    gate = asyncio.Semaphore(64)

    async def open_one(i: int) -> None:
        async with gate:
            ws = await connect_counted(failed, connect(p["url"], None, timeout_s=15))
            if ws is None:
                return
        opened.append((ws, asyncio.ensure_future(watch(i, ws, time.monotonic()))))

    async def watch(i: int, ws, t_open: float) -> None:
        await ws.wait_closed()
        closed_at[i] = (ws.close_code, time.monotonic() - t_open)

    emit(start=time.monotonic())
    await asyncio.gather(*(open_one(i) for i in range(p["sockets"])))
    ready()
    await asyncio.sleep(p["hold_s"])
    by_server = collections.Counter(code for code, _ in closed_at.values())
    after = sorted(t for _, t in closed_at.values())
    still_open = len(opened) - len(closed_at)
    for ws, _ in opened:
        ws.transport.abort()                   # a thousand closing handshakes would be an attack of their own
    await asyncio.gather(*(task for _, task in opened), return_exceptions=True)
    parts = [f"{len(opened)} opened", f"{still_open} still open after {p['hold_s']:g} s"]
    parts += [f"closed {code}×{n}" for code, n in by_server.most_common()]
    parts += [f"{k}×{n}" for k, n in failed.most_common()]
    return {"opened": len(opened), "still_open": still_open, "failed": dict(failed),
            "closed_by_server": {str(k): n for k, n in by_server.items()},
            "closed_after_s_median": round(after[len(after) // 2], 2) if after else None,
            "outcome": ", ".join(parts)}


async def chunked_body(p: dict) -> dict:
    """A chat request whose chunked body grows to body_mib MiB (a JSON string that never ends)."""
    block = b"a" * MiB
    chunks = [b'{"messages": [{"role": "user", "content": "'] + [block] * p["body_mib"]
    emit(start=time.monotonic())
    r = await raw_post(p["url"], p["key"], chunks, length=None, timeout_s=p["timeout_s"], on_sent=ready)
    return {**r, "outcome": _describe_http(r)}


async def deep_json(p: dict) -> dict:
    """JSON nested `depth` deep: as an HTTP body, and as a frame on a socket that also carries
    a normal request (which must still end normally)."""
    nest = "[" * p["depth"] + "]" * p["depth"]
    emit(start=time.monotonic())
    body = f'{{"messages": {nest}}}'.encode()
    http = await raw_post(p["url"], p["key"], [body], length=len(body), timeout_s=p["timeout_s"])
    ws = await connect(p["url"], p["key"])
    try:
        code = await send_all(ws, [json.dumps({"type": "chat.request", "id": "other", "max_tokens": 16,
                                                "ignore_eos": True,
                                                "messages": [{"role": "user", "content": "Count to ten."}]}),
                                    f'{{"type": "chat.request", "id": "deep", "messages": {nest}}}'])
        ready()
        got, closed = await request_outcomes(ws, {"deep", "other"}, p["timeout_s"])
        code = code or closed
    finally:
        await ws.close()
    parts = [f"{k} {got.get(k, 'no answer')}" for k in ("deep", "other")]
    parts += [f"{k} {v}" for k, v in got.items() if k.startswith("error(")] + ([f"closed {code}"] if code else [])
    ws_part = ", ".join(parts)
    return {"http": http, "ws_answers": got, "ws_close_code": code,
            "outcome": f"HTTP {_describe_http(http)}; WS: {ws_part}"}


async def lone_surrogate(p: dict) -> dict:
    """A WebSocket chat.request whose id is a lone surrogate ("\\ud800"): does it get its one
    terminal event?"""
    ws = await connect(p["url"], p["key"])
    try:
        emit(start=time.monotonic())
        code = await send_all(ws, [json.dumps({"type": "chat.request", "id": "\ud800", "max_tokens": 8,
                                                "messages": [{"role": "user", "content": "Say hi."}]})])
        ready()
        got, closed = await request_outcomes(ws, {"\ud800"}, p["hold_s"])
        code = code or closed
    finally:
        await ws.close()
    terminal = got.get("\ud800") or next((v for k, v in got.items() if k.startswith("error(")), None)
    outcome = f"terminal event: {terminal}" if terminal else f"no terminal event in {p['hold_s']:g} s"
    return {"answers": {k.encode("unicode_escape").decode(): v for k, v in got.items()}, "close_code": code,
            "outcome": outcome + (f"; closed {code}" if code else "")}


ATTACKS = {f.__name__: f for f in (big_prompt, big_frames, stats_flood, keyless_ws, chunked_body, deep_json,
                                   lone_surrogate, *MORE)}


def main() -> int:
    name, params = sys.argv[1], json.loads(sys.argv[2])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    try:
        result = asyncio.run(ATTACKS[name](params))
    except Exception as exc:          # e.g. the attacker's own socket refused: still a result
        result = {"outcome": f"attack failed: {type(exc).__name__}: {exc}"[:300]}
    emit(result=result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
