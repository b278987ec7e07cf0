"""The WebSocket protocol at `/v1/chat/ws` (DESIGN.md, docs/PROTOCOL.md). This module
only adapts `chat.ChatService` events to JSON frames; several requests share one socket,
told apart by the client's `id`.

Connection states: AUTHENTICATING → OPEN → CLOSED. Before `auth` (or a valid
Authorization header) only `auth` and `ping` are allowed; anything else closes with 1008.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
from urllib.parse import urlsplit

import structlog
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from .auth import authenticate, bearer_key
from .chat import Admission, Delta, Done
from .errors import (WS_INTERNAL_ERROR, WS_MESSAGE_TOO_BIG, WS_POLICY_VIOLATION, WS_SERVICE_RESTART, WS_TRY_AGAIN_LATER, AuthError,
                     BadRequest, GatewayError, RateLimited)
from .live import snapshot

log = structlog.get_logger("streamgate.ws")


class State(enum.Enum):
    AUTHENTICATING = "authenticating"
    OPEN = "open"
    CLOSED = "closed"


def origin_allowed(websocket: WebSocket, allowed: tuple[str, ...]) -> bool:
    """Browsers send Origin; it must match the Host we were reached at or be listed.
    Non-browser clients send no Origin and are not affected (they authenticate with a key)."""
    origin = websocket.headers.get("origin")
    if origin is None:
        return True
    if urlsplit(origin).netloc.lower() == websocket.headers.get("host", "").lower():
        return True
    return "*" in allowed or origin.rstrip("/") in allowed


class Connection:
    def __init__(self, websocket: WebSocket, gw):
        self.ws = websocket
        self.gw = gw
        self.state = State.AUTHENTICATING
        self.tenant = None
        self.streams: dict[str, tuple[Admission, asyncio.Task]] = {}
        self.stats_task: asyncio.Task | None = None
        self._send_lock = asyncio.Lock()

    async def serve(self) -> None:
        settings = self.gw.settings
        if not origin_allowed(self.ws, settings.allowed_origins):
            await self.ws.close(code=WS_POLICY_VIOLATION, reason="origin not allowed")   # before accept: HTTP 403
            return
        await self.ws.accept()
        if self.gw.chat.draining:
            return await self.close(WS_SERVICE_RESTART, "server is shutting down")
        if self.gw.open_sockets >= settings.max_sockets:
            return await self.close(WS_TRY_AGAIN_LATER, "too many connections; retry later")
        self.gw.open_sockets += 1           # before any await, so the limit holds
        self.gw.metrics.websockets.inc()
        drain_watch = asyncio.ensure_future(self._close_when_drained())
        try:
            header_key = bearer_key(self.ws.headers.get("authorization"))
            if header_key is None or await self._auth(header_key):
                await self._receive_loop()
        except _Gone:
            pass                            # the client left while we were answering
        except Exception:
            log.exception("ws.fault")
            await self.close(WS_INTERNAL_ERROR, "internal server error")
        finally:
            self.gw.open_sockets -= 1
            self.gw.metrics.websockets.dec()
            self.state = State.CLOSED
            drain_watch.cancel()
            tasks = [task for _, task in self.streams.values()] + ([self.stats_task] if self.stats_task else [])
            for task in tasks:
                task.cancel()       # closes each pipeline: engine abort + lease settled
            await asyncio.gather(*tasks, return_exceptions=True)
            for adm, _ in list(self.streams.values()):     # tasks cancelled before they ever ran
                self.gw.chat.release(adm)
            self.streams.clear()

    async def _receive_loop(self) -> None:
        limit = self.gw.settings.max_frame_bytes
        while self.state is not State.CLOSED:
            try:
                message = await self.ws.receive()
            except (WebSocketDisconnect, RuntimeError):
                return
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                data = message.get("bytes") or b""
                if len(data) > limit:
                    return await self.close(WS_MESSAGE_TOO_BIG, f"frame larger than {limit} bytes")
                await self.send_error(None, BadRequest("binary frames are not supported; send JSON text frames"))
                continue
            if len(text) > limit and len(text.encode()) > limit:
                return await self.close(WS_MESSAGE_TOO_BIG, f"frame larger than {limit} bytes")
            await self._handle(text)

    async def _handle(self, text: str) -> None:
        try:
            msg = json.loads(text)
        except ValueError:
            return await self.send_error(None, BadRequest("the frame is not valid JSON", code="invalid_json"))
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "ping":
            return await self.send({"type": "pong"})
        if kind == "auth":
            if self.state is State.OPEN:
                return await self.send_error(None, BadRequest("already authenticated", param="type"))
            key = msg.get("api_key")
            await self._auth(key if isinstance(key, str) else None)
            return
        if self.state is State.AUTHENTICATING:
            return await self.close(WS_POLICY_VIOLATION, "authenticate first: send {\"type\": \"auth\", \"api_key\": ...}")
        if kind == "chat.request":
            return await self._chat(msg)
        if kind == "chat.cancel":
            entry = self.streams.get(_key(msg.get("id")))
            if entry is not None:
                await self.gw.chat.cancel(entry[0])
            return
        if kind == "stats.subscribe":
            return self._subscribe(msg.get("interval_ms", 500))
        if kind == "stats.unsubscribe":
            if self.stats_task is not None:
                self.stats_task.cancel()
                self.stats_task = None
            return
        await self.send_error(msg.get("id") if isinstance(msg, dict) else None,
                              BadRequest(f"type: unknown message type {kind!r}", param="type"))

    async def _auth(self, key: str | None) -> bool:
        try:
            self.tenant = authenticate(self.gw.registry, key)
        except AuthError as exc:
            await self.close(WS_POLICY_VIOLATION, exc.message)
            return False
        self.state = State.OPEN
        await self.send({"type": "auth.ok", "tenant": self.tenant.name})
        return True

    async def _chat(self, msg: dict) -> None:
        cid = msg.get("id")
        if not isinstance(cid, (str, int)) or isinstance(cid, bool) or not 0 < len(str(cid)) <= 128:
            return await self.send_error(None, BadRequest("id: a chat.request needs an id (string, 1-128 chars)",
                                                          param="id"))
        if _key(cid) in self.streams:
            return await self.send_error(cid, BadRequest(f"id: request {cid!r} is still running on this socket",
                                                         param="id", code="duplicate_id"))
        if len(self.streams) >= self.gw.settings.max_requests_per_socket:
            return await self.send_error(cid, RateLimited(
                f"at most {self.gw.settings.max_requests_per_socket} requests may run at once on one socket",
                reason="requests_per_socket", retry_after=None))
        body = {k: v for k, v in msg.items() if k not in ("type", "id", "stream", "stream_options")}
        timeout = body.pop("timeout_s", None)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < float("inf")):
            return await self.send_error(cid, BadRequest(
                f"timeout_s: must be a positive number of seconds (got {timeout!r})", param="timeout_s"))
        try:
            adm = self.gw.chat.admit(self.tenant, body, transport="ws",
                                     timeout_header=None if timeout is None else str(timeout))
        except GatewayError as exc:
            return await self.send_error(cid, exc)
        self.streams[_key(cid)] = (adm, asyncio.ensure_future(self._stream(cid, adm)))

    async def _stream(self, cid, adm: Admission) -> None:
        events = self.gw.chat.run(adm)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Delta):
                        await self.send({"type": "chat.delta", "id": cid, "text": event.text,
                                         "num_tokens": event.num_tokens})
                    elif isinstance(event, Done):
                        await self.send({"type": "chat.done", "id": cid, "finish_reason": event.finish_reason,
                                         "usage": event.usage.as_dict(), "timings": event.timings})
                    else:
                        await self.send_error(cid, event.error)
        except _Gone:
            pass        # the socket went away; aclosing ended the pipeline (abort + settle)
        finally:
            self.streams.pop(_key(cid), None)

    def _subscribe(self, interval_ms) -> None:
        ok = isinstance(interval_ms, (int, float)) and not isinstance(interval_ms, bool) and 0 < interval_ms < 1e7
        interval = min(10.0, max(0.1, interval_ms / 1000)) if ok else 0.5
        if self.stats_task is not None:
            self.stats_task.cancel()

        async def push() -> None:
            with contextlib.suppress(_Gone):
                while True:
                    await self.send(snapshot(self.gw, interval))
                    await asyncio.sleep(interval)

        self.stats_task = asyncio.ensure_future(push())

    async def _close_when_drained(self) -> None:
        """When the server drains, close with 1012 once this socket's requests have ended."""
        await self.gw.drain_started.wait()
        while self.streams:
            await asyncio.sleep(0.05)
        await self.close(WS_SERVICE_RESTART, "server is shutting down")

    # -- output ------------------------------------------------------------------------------
    async def send(self, payload: dict) -> None:
        """Send one frame; raises _Gone if the socket is closed or closing."""
        async with self._send_lock:
            if self.ws.application_state is not WebSocketState.CONNECTED:
                raise _Gone()
            try:
                await self.ws.send_text(json.dumps(payload, ensure_ascii=False))
            except (WebSocketDisconnect, RuntimeError, OSError) as exc:
                raise _Gone() from exc

    async def send_error(self, cid, exc: GatewayError) -> None:
        error = exc.body()["error"]
        if exc.retry_after is not None:
            error["retry_after"] = round(exc.retry_after, 3)
        await self.send({"type": "error", "id": cid, "error": error})

    async def close(self, code: int, reason: str) -> None:
        self.state = State.CLOSED
        log.info("ws.close", code=code, reason=reason)
        async with self._send_lock:
            if self.ws.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(RuntimeError, OSError):
                    await self.ws.close(code=code, reason=reason[:120])


class _Gone(Exception):
    """The socket is closed: stop sending on it."""


def _key(cid) -> str:
    return str(cid)


async def chat_socket(websocket: WebSocket) -> None:
    await Connection(websocket, websocket.app.state.gateway).serve()
