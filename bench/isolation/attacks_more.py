"""The attacks issue 25 added to `bench.isolation` (run like the others, by
bench/isolation/attacks.py, each in a process of its own): a HEAD flood on /v1/stats,
compressed frame bombs, clients that never read their SSE stream, a flood of keyed
WebSocket upgrades, and a flood of large bodies from a tenant already over its quota.
Every wait is bounded; whatever the server answers is the result."""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import time
import zlib
from urllib.parse import urlsplit

from bench.isolation.client import close_code, connect, connect_counted, raw_post, ws_url


def emit(**msg) -> None:
    print(json.dumps(msg), flush=True)


def ready() -> None:
    emit(ready=time.monotonic())


def _counts(counter: collections.Counter) -> str:
    return ", ".join(f"{k}×{n}" for k, n in counter.most_common()) or "nothing"


async def head_flood(p: dict) -> dict:
    """`head_requests` HEAD /v1/stats with A's key, 8 at a time on kept-alive connections
    (each used to leave a stats subscriber behind for good)."""
    import httpx

    statuses: collections.Counter = collections.Counter()
    left = [p["head_requests"]]
    async with httpx.AsyncClient(base_url=p["url"], timeout=httpx.Timeout(30.0),
                                 headers={"Authorization": f"Bearer {p['key']}"}) as client:
        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                try:
                    statuses[str((await client.head("/v1/stats")).status_code)] += 1
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1

        emit(start=time.monotonic())
        await asyncio.gather(*(worker() for _ in range(8)))
    ready()
    await asyncio.sleep(p["hold_s"])
    return {"statuses": dict(statuses), "outcome": _counts(statuses)}


async def deflate_bomb(p: dict) -> dict:
    """With no key, `bomb_frames` ping frames that each inflate to ~100 KB of JSON values
    (~200 B on the wire if the server negotiates permessage-deflate); then, with A's key,
    one chat.request of 33k empty messages (~2.4 KB deflated)."""
    import websockets

    pad = json.dumps({"type": "ping", "pad": [0] * 50_000})
    emit(start=time.monotonic())
    parts, sent, code, extensions = [], 0, None, []
    try:
        ws = await websockets.connect(ws_url(p["url"]), compression="deflate", max_size=None, open_timeout=15,
                                      close_timeout=2)
        extensions = [e.name for e in ws.protocol.extensions]
        try:
            for _ in range(p["bomb_frames"]):
                await ws.send(pad)
                sent += 1
            await asyncio.wait_for(ws.recv(), 5)
        except websockets.ConnectionClosed as exc:
            code = close_code(exc)
        except (TimeoutError, asyncio.TimeoutError):
            pass
        finally:
            await ws.close()
    except (OSError, websockets.InvalidStatus) as exc:
        parts.append(f"keyless connect failed: {type(exc).__name__}")
    wire = len(zlib.compress(pad.encode())) if extensions else len(pad)
    parts.insert(0, f"keyless: deflate {'on' if extensions else 'off'}, {sent} frames of ~{wire:,} B sent, "
                    f"closed {code}")
    ready()
    body = json.dumps({"type": "chat.request", "id": "bomb", "max_tokens": 1,
                       "messages": [{"role": "user", "content": ""}] * 33_000})
    keyed = None
    try:
        ws = await connect(p["url"], p["key"])
        try:
            await ws.send(body)
            keyed = json.loads(await asyncio.wait_for(ws.recv(), 60)).get("error", {}).get("code") or "answered"
        except websockets.ConnectionClosed as exc:
            keyed = f"closed {close_code(exc)}"
        finally:
            await ws.close()
    except (OSError, TimeoutError, asyncio.TimeoutError, websockets.InvalidStatus) as exc:
        keyed = type(exc).__name__
    parts.append(f"keyed 33k-message request: {keyed}")
    return {"extensions": extensions, "frames_sent": sent, "close_code": code, "keyed": keyed,
            "outcome": "; ".join(parts)}


async def stuck_readers(p: dict) -> dict:
    """`stuck_streams` streaming chat requests with A's key, opened one after another at
    whatever rate A's quota admits, each on a socket that reads the status line and never
    again; held for hold_s, then: which of them did the server drop?"""
    parts = urlsplit(p["url"])
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
                       "max_tokens": 256, "ignore_eos": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {p['key']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    loop, statuses, held = asyncio.get_running_loop(), collections.Counter(), []
    emit(start=time.monotonic())
    for _ in range(p["stuck_streams"]):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (parts.hostname, parts.port))
            await loop.sock_sendall(sock, head + body)
            line = await asyncio.wait_for(loop.sock_recv(sock, 12), 30)
            status = line.split()[1].decode() if len(line.split()) > 1 else "?"
        except (OSError, TimeoutError, asyncio.TimeoutError) as exc:
            status = type(exc).__name__
        statuses[status] += 1
        if status == "200":
            held.append(sock)
        else:
            sock.close()
            await asyncio.sleep(0.2)            # over A's concurrency: try again shortly
    ready()
    await asyncio.sleep(p["hold_s"])
    ends: collections.Counter = collections.Counter()
    for sock in held:       # read what is buffered: a whole answer ([DONE]), or cut off (EOF / reset), or neither
        tail, end = b"", "still open"
        try:
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 2):
                tail = (tail + chunk)[-64:]
                if b"[DONE]" in tail:
                    end = "completed (it fitted in the buffers)"
                    break
            else:
                end = "dropped by the server"
        except ConnectionResetError:
            end = "dropped by the server"
        except (OSError, TimeoutError, asyncio.TimeoutError):
            pass
        ends[end] += 1
        sock.close()
    return {"statuses": dict(statuses), "held": len(held), "ends": dict(ends),
            "outcome": f"{_counts(statuses)}; of {len(held)} unread streams: {_counts(ends)}"}


async def keyed_upgrades(p: dict) -> dict:
    """`upgrades` WebSocket upgrades with A's key in the Authorization header, 64 at a
    time, each dropped once open."""
    import websockets

    results: collections.Counter = collections.Counter()
    gate = asyncio.Semaphore(64)

    async def one() -> None:
        async with gate:
            ws = await connect_counted(results, websockets.connect(
                ws_url(p["url"]), open_timeout=15, close_timeout=1,
                additional_headers={"Authorization": f"Bearer {p['key']}"}))
            if ws is None:
                return
            results["101"] += 1
            ws.transport.abort()

    emit(start=time.monotonic())
    await asyncio.gather(*(one() for _ in range(p["upgrades"])))
    ready()
    return {"results": dict(results), "outcome": _counts(results)}


async def overquota_parse(p: dict) -> dict:
    """A spends its requests per minute on small requests, then sends `parse_requests`
    bodies of ~0.9 MB (25k messages, under the body limit), 4 at a time: each used to be
    decoded, validated and estimated before the quota refused it. It uses `parse_key`: A's
    tenant for this attack, whose 1 request a minute does not come back within the attack
    however slow the host (A's own 120 a minute give one back every 0.5 s, and a slow
    host's big bodies then arrived under quota and were parsed)."""
    small = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    big = json.dumps({"messages": [{"role": "user", "content": ""}] * 25_000, "max_tokens": 1}).encode()   # < 1 MiB
    statuses: collections.Counter = collections.Counter()
    spent = 0
    emit(start=time.monotonic())
    while spent < 400:                          # until the quota refuses
        r = await raw_post(p["url"], p["parse_key"], [small], length=len(small), timeout_s=30)
        spent += 1
        if r["status"] == 429 and r["code"] == "requests_per_minute":
            break
    ready()
    gate = asyncio.Semaphore(4)

    async def one() -> None:
        async with gate:
            r = await raw_post(p["url"], p["parse_key"], [big], length=len(big), timeout_s=30)
            statuses[f"{r['status']} {r['code'] or ''}".strip() if r["status"] else r.get("error", "?")] += 1

    await asyncio.gather(*(one() for _ in range(p["parse_requests"])))
    return {"spent": spent, "statuses": dict(statuses),
            "outcome": f"{spent} small requests to reach the quota, then {_counts(statuses)}"}


MORE = (head_flood, deflate_bomb, stuck_readers, keyed_upgrades, overquota_parse)
