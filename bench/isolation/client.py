"""Client helpers shared by the isolation benchmark's attacker and victim: a raw HTTP POST
that sees early answers, and WebSocket connect / send / read-until-terminal that report
what the server did (an error code, a close code) instead of raising."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

from websockets.exceptions import ConnectionClosed

MiB = 1 << 20


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://", 1) + "/v1/chat/ws"


def error_code(body: bytes) -> str | None:
    """The OpenAI-shaped error's `code` in a response body (its JSON object, however framed)."""
    try:
        err = json.loads(body[body.index(b"{"):body.rindex(b"}") + 1]).get("error")
    except ValueError:
        return None
    return err.get("code") if isinstance(err, dict) else None


def close_code(exc: BaseException) -> int | None:
    rcvd = getattr(exc, "rcvd", None)
    return rcvd.code if rcvd is not None else None


async def _read_answer(sock: socket.socket, data: bytearray, answered: asyncio.Event,
                       limit: int = 64 * 1024) -> None:
    """Up to `limit` bytes of the answer into `data`, until the server closes; sets `answered`
    at the first byte. A bare socket, not a StreamReader: when the server resets the connection (it closes
    with our body unread), the kernel still hands over what arrived before the reset, while a
    StreamReader raises and drops it."""
    loop = asyncio.get_running_loop()
    while len(data) < limit:
        try:
            chunk = await loop.sock_recv(sock, limit - len(data))
        except OSError:
            break
        if not chunk:
            break
        data += chunk
        answered.set()


async def raw_post(url: str, key: str, chunks, *, length: int | None, timeout_s: float, on_sent=None) -> dict:
    """POST /v1/chat/completions over a bare socket, writing the body while reading the answer,
    so an early answer (a 413 before the body is read) is seen instead of lost in a write
    error. `length=None` sends the chunks with chunked transfer encoding. `on_sent()` is
    called once the whole body is written (never, if the server answered first)."""
    parts = urlsplit(url)
    head = ["POST /v1/chat/completions HTTP/1.1", f"Host: {parts.netloc}", f"Authorization: Bearer {key}",
            "Content-Type: application/json", "Connection: close",
            f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"]
    loop, t0, sent = asyncio.get_running_loop(), time.monotonic(), 0
    sock = socket.socket(socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET)
    sock.setblocking(False)

    async def write() -> None:
        nonlocal sent
        await loop.sock_sendall(sock, ("\r\n".join(head) + "\r\n\r\n").encode())
        for chunk in chunks:
            await loop.sock_sendall(sock, chunk if length is not None else b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        if length is None:
            await loop.sock_sendall(sock, b"0\r\n\r\n")
        if on_sent:
            on_sent()

    out: dict = {"status": None, "code": None}
    answer, answered = bytearray(), asyncio.Event()
    tasks: list[asyncio.Task] = []
    try:
        await loop.sock_connect(sock, (parts.hostname, parts.port))
        tasks = [asyncio.ensure_future(write()), asyncio.ensure_future(_read_answer(sock, answer, answered)),
                 asyncio.ensure_future(answered.wait())]
        await asyncio.wait(tasks[1:], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not answered.is_set():
            out["error"] = "connection closed without an answer" if tasks[1].done() else f"no answer in {timeout_s:g} s"
            return out
        out["answered_s"] = round(time.monotonic() - t0, 3)
        out["body_sent_mib"] = round(sent / MiB, 2)
        tasks[0].cancel()
        await asyncio.wait(tasks[1:2], timeout=10.0)        # the rest of the answer, as far as it comes
        head_line, _, rest = bytes(answer).partition(b"\r\n")
        out["status"] = int(head_line.split()[1])
        out["code"] = error_code(rest.partition(b"\r\n\r\n")[2])
    except (OSError, ValueError, IndexError) as exc:
        out["error"] = type(exc).__name__
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sock.close()
    return out


async def request_outcomes(ws, ids: set[str], timeout_s: float) -> tuple[dict, int | None]:
    """Read frames until as many terminal events (`chat.done` or `error`) as requests in `ids`
    arrived, the socket closes, or the time is up: each request ends with exactly one, keyed
    by its id or, when the server could not read the id, by none. Returns ({id, or
    "error(id=…)" for one it could not tie to a request: finish_reason / error code}, close
    code)."""
    got: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < len(ids):
            msg = json.loads(await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic())))
            rid = msg.get("id")
            if msg.get("type") == "chat.done" and rid in ids:
                got[rid] = msg.get("finish_reason")
            elif msg.get("type") == "error":
                key = rid if rid in ids else f"error(id={rid!r})#{len(got)}"
                got[key] = msg["error"].get("code")
    except (TimeoutError, asyncio.TimeoutError):
        pass
    except ConnectionClosed as exc:
        return got, close_code(exc)
    return got, None


async def send_all(ws, frames) -> int | None:
    """Send the frames; the close code if the server closed the socket meanwhile."""
    try:
        for frame in frames:
            await ws.send(frame)
    except ConnectionClosed as exc:
        return close_code(exc)
    return None


async def connect(url: str, key: str | None, timeout_s: float = 30.0):
    from websockets.asyncio.client import connect

    headers = {"Authorization": f"Bearer {key}"} if key else None
    ws = await connect(ws_url(url), additional_headers=headers, max_size=None, open_timeout=timeout_s,
                       close_timeout=2)
    if key:
        await asyncio.wait_for(ws.recv(), timeout_s)            # auth.ok
    return ws


async def connect_counted(failures, opening):
    """Await `opening` (a WebSocket handshake); a refusal counts in `failures` (a Counter) as
    "HTTP <status>", any other failure by its exception's name, and gives None."""
    import websockets

    try:
        return await opening
    except websockets.InvalidStatus as exc:
        failures[f"HTTP {exc.response.status_code}"] += 1
    except Exception as exc:
        failures[type(exc).__name__] += 1
    return None
