"""The WebSocket protocol at `/v1/chat/ws` (DESIGN.md, docs/PROTOCOL.md). This module
only adapts `ChatService` events to JSON frames; several requests share one socket,
told apart by the client's `id`.

Connection states: CONNECTING → AUTHENTICATING → OPEN → CLOSED, changed only through
`_to()`, which raises on any other transition. Before `auth` (or a valid Authorization
header) only `auth` and `ping` are allowed, and only for `ws_auth_timeout_s`. A socket
without an Authorization header waits among the unauthenticated ones (their own small
pool) until it authenticates, then holds one place among the authenticated ones and one
of its tenant's: keyless sockets never take the places of authenticated ones. Close
codes come from the error classes (gateway/errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
from urllib.parse import urlsplit

import structlog
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from .admission import Admission
from .auth import authenticate, bearer_key
from .errors import (WS_NORMAL_CLOSURE, AuthError, BadRequest, Draining, GatewayError, InternalError,
                     PayloadTooLarge, PolicyViolation, RateLimited, TooManyConnections)
from .live import interval_class
from .schemas import timeout_from_field
from .sse import parse_json
from .streaming import Delta, Done

log = structlog.get_logger("streamgate.ws")

MAX_ID_CHARS = 128
AUTHENTICATED = "authenticated"


class State(enum.Enum):
    CONNECTING = "connecting"
    AUTHENTICATING = "authenticating"
    OPEN = "open"
    CLOSED = "closed"


_NEXT = {State.CONNECTING: {State.AUTHENTICATING, State.CLOSED},
         State.AUTHENTICATING: {State.OPEN, State.CLOSED},
         State.OPEN: {State.CLOSED},
         State.CLOSED: set()}


def origin_allowed(websocket: WebSocket, allowed: tuple[str, ...]) -> bool:
    """Browsers send Origin; it must match the Host we were reached at or be listed.
    Non-browser clients send no Origin and are not affected (they authenticate with a key)."""
    origin = websocket.headers.get("origin")
    if origin is None:
        return True
    if urlsplit(origin).netloc.lower() == websocket.headers.get("host", "").lower():
        return True
    return "*" in allowed or origin.rstrip("/").lower() in {a.rstrip("/").lower() for a in allowed}


def valid_id(cid: object) -> bool:
    """A request id is a printable string of 1-128 characters (no lone surrogates, which
    no frame could carry) or an integer a JSON client can represent exactly."""
    if isinstance(cid, str):
        return 0 < len(cid) <= MAX_ID_CHARS and cid.isprintable()
    return isinstance(cid, int) and not isinstance(cid, bool) and abs(cid) < 2**53


class Connection:
    def __init__(self, websocket: WebSocket, gw):
        self.ws = websocket
        self.gw = gw
        self.state = State.CONNECTING
        self.tenant = None
        self.places: list[str] = []         # what this socket holds in gw.sockets
        self.streams: dict[str, tuple[Admission, asyncio.Task]] = {}
        self.stats_task: asyncio.Task | None = None
        self._send_lock = asyncio.Lock()

    def _to(self, state: State) -> None:
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"illegal WebSocket transition {self.state.value} -> {state.value}")
        self.state = state

    async def serve(self) -> None:
        settings = self.gw.settings
        if not origin_allowed(self.ws, settings.allowed_origins):
            self._to(State.CLOSED)
            await self.ws.close(code=PolicyViolation.ws_close, reason="origin not allowed")  # before accept: 403
            return
        await self.ws.accept()
        self._to(State.AUTHENTICATING)
        if self.gw.chat.draining:
            return await self.close(Draining("server is shutting down"))
        self.gw.metrics.websockets.inc()
        drain_watch = asyncio.ensure_future(self._close_when_drained())
        try:
            header_key = bearer_key(self.ws.headers.get("authorization"))
            if header_key is not None:
                if await self._auth(header_key):
                    await self._receive_loop()
            else:
                await self._wait_in_pending()
                await self._receive_loop()
        except _Gone:
            pass                            # the client left while we were answering
        except Exception as exc:
            log.error("ws.fault", error=type(exc).__name__)     # no payloads in logs
            await self.close(InternalError("internal server error"))
        finally:
            self.gw.pending_sockets.pop(self, None)
            for place in self.places:
                self.gw.sockets.give(place)
            self.places.clear()
            self.gw.metrics.websockets.dec()
            if self.state is not State.CLOSED:
                self._to(State.CLOSED)
            drain_watch.cancel()
            self._unsubscribe()
            tasks = [task for _, task in self.streams.values()]
            for task in tasks:
                task.cancel()       # closes each pipeline: engine abort + lease settled
            await asyncio.gather(*tasks, return_exceptions=True)
            for adm, _ in list(self.streams.values()):     # tasks cancelled before they ever ran
                self.gw.chat.release(adm)
            self.streams.clear()

    async def _wait_in_pending(self) -> None:
        """Join the unauthenticated sockets; when they are at their cap, the one waiting
        longest is closed 1013 to make room, so keyless sockets can delay a newcomer's
        auth by at most one round of the pool, never lock it out."""
        pending = self.gw.pending_sockets       # insertion-ordered: oldest first
        if len(pending) >= self.gw.settings.max_unauthenticated_sockets:
            oldest = next(iter(pending))
            del pending[oldest]
            evict = asyncio.ensure_future(oldest.close(TooManyConnections(
                "too many unauthenticated connections; this one waited longest without authenticating")))
            _evictions.add(evict)       # (a task needs a reference until it is done)
            evict.add_done_callback(_evictions.discard)
        pending[self] = None

    async def _receive_loop(self) -> None:
        settings, loop = self.gw.settings, asyncio.get_running_loop()
        auth_by = loop.time() + settings.ws_auth_timeout_s
        while self.state is not State.CLOSED:
            authenticating = self.state is State.AUTHENTICATING
            wait = auth_by - loop.time() if authenticating else settings.ws_idle_timeout_s
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout=max(0.0, wait))
            except asyncio.TimeoutError:
                if authenticating:
                    return await self.close(PolicyViolation(
                        f"authenticate within {settings.ws_auth_timeout_s:g} s: send {{\"type\": \"auth\"}}"))
                if not self.streams and self.stats_task is None:
                    return await self.close(None, f"idle for {settings.ws_idle_timeout_s:g} s")
                continue
            except (WebSocketDisconnect, RuntimeError):
                return
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                data = message.get("bytes") or b""
                if len(data) > settings.max_frame_bytes:
                    return await self.close(PayloadTooLarge(f"frame larger than {settings.max_frame_bytes} bytes"))
                await self.send_error(None, BadRequest("binary frames are not supported; send JSON text frames"))
                continue
            if len(text) > settings.max_frame_bytes and len(text.encode()) > settings.max_frame_bytes:
                return await self.close(PayloadTooLarge(f"frame larger than {settings.max_frame_bytes} bytes"))
            await self._handle(text)

    async def _handle(self, text: str) -> None:
        try:
            msg = parse_json(text)
        except BadRequest:
            return await self.send_error(None, BadRequest("the frame is not valid JSON", code="invalid_json"))
        kind = msg.get("type") if isinstance(msg, dict) else None
        cid = msg.get("id") if isinstance(msg, dict) else None
        cid = cid if valid_id(cid) else None
        if kind == "ping":
            return await self.send({"type": "pong"})
        if kind == "auth":
            if self.state is State.OPEN:
                return await self.send_error(None, BadRequest("already authenticated", param="type"))
            key = msg.get("api_key")
            await self._auth(key if isinstance(key, str) else None)
            return
        if self.state is State.AUTHENTICATING:
            return await self.close(PolicyViolation("authenticate first: send {\"type\": \"auth\", \"api_key\": ...}"))
        if kind == "chat.request":
            return await self._chat(msg)
        if kind == "chat.cancel":
            entry = self.streams.get(_key(cid)) if cid is not None else None
            if entry is not None:
                await self.gw.chat.cancel(entry[0])
            return
        if kind == "stats.subscribe":
            return await self._subscribe(msg.get("interval_ms", 500))
        if kind == "stats.unsubscribe":
            return self._unsubscribe()
        await self.send_error(cid, BadRequest(f"type: unknown message type {str(kind)[:40]!r}", param="type"))

    async def _auth(self, key: str | None) -> bool:
        settings, sockets = self.gw.settings, self.gw.sockets
        try:
            tenant = authenticate(self.gw.registry, key)
        except AuthError as exc:
            await self.close(exc)
            return False
        per_tenant = f"tenant:{tenant.name}"
        if not sockets.take(per_tenant, settings.max_sockets_per_tenant):
            await self.close(TooManyConnections(f"tenant {tenant.name!r} has {settings.max_sockets_per_tenant} "
                                                "sockets open; close one first"))
            return False
        if not sockets.take(AUTHENTICATED, settings.max_sockets):
            sockets.give(per_tenant)
            await self.close(TooManyConnections("too many connections; retry later"))
            return False
        self.gw.pending_sockets.pop(self, None)
        self.places = [AUTHENTICATED, per_tenant]
        self.tenant = tenant
        self._to(State.OPEN)
        await self.send({"type": "auth.ok", "tenant": tenant.name})
        return True

    async def _chat(self, msg: dict) -> None:
        cid = msg.get("id")
        if not valid_id(cid):
            return await self.send_error(None, BadRequest(
                f"id: a chat.request needs an id: a printable string of 1-{MAX_ID_CHARS} characters or an integer",
                param="id"))
        if _key(cid) in self.streams:
            return await self.send_error(cid, BadRequest(f"id: request {cid!r} is still running on this socket",
                                                         param="id", code="duplicate_id"))
        if len(self.streams) >= self.gw.settings.max_requests_per_socket:
            return await self.send_error(cid, RateLimited(
                f"at most {self.gw.settings.max_requests_per_socket} requests may run at once on one socket",
                reason="requests_per_socket", retry_after=None))
        body = {k: v for k, v in msg.items() if k not in ("type", "id", "stream", "stream_options", "timeout_s")}
        try:
            timeout_s = timeout_from_field(msg.get("timeout_s"))
            adm = await self.gw.chat.admit(self.tenant, body, transport="ws", timeout_s=timeout_s)
        except GatewayError as exc:
            return await self.send_error(cid, exc)
        if self.state is State.CLOSED:      # the socket closed while the prompt was tokenized
            return self.gw.chat.release(adm)
        self.streams[_key(cid)] = (adm, asyncio.ensure_future(self._stream(cid, adm)))

    async def _stream(self, cid, adm: Admission) -> None:
        events = self.gw.chat.run(adm)
        ended = False
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Delta):
                        await self.send({"type": "chat.delta", "id": cid, "text": event.text,
                                         "num_tokens": event.num_tokens})
                        continue
                    ended = True
                    if isinstance(event, Done):
                        await self.send({"type": "chat.done", "id": cid, "finish_reason": event.finish_reason,
                                         "usage": event.usage.as_dict(), "timings": event.timings})
                    else:
                        await self.send_error(cid, event.error)
        except _Gone:
            pass        # the socket went away; aclosing ended the pipeline (abort + settle)
        except Exception as exc:
            log.error("ws.stream_fault", completion_id=adm.request_id, error=type(exc).__name__)
            if not ended:
                with contextlib.suppress(_Gone):
                    await self.send_error(cid, InternalError("the request failed inside the gateway"))
        finally:
            self.streams.pop(_key(cid), None)

    async def _subscribe(self, interval_ms) -> None:
        """One subscription per socket; it holds one of the tenant's stats places."""
        if self.stats_task is not None:
            self.stats_task.cancel()        # a new interval: the place is kept
        elif not self.gw.stats_slots.take(self.tenant.name, self.gw.settings.max_stats_streams_per_tenant):
            return await self.send_error(None, TooManyConnections(
                f"tenant {self.tenant.name!r} has {self.gw.settings.max_stats_streams_per_tenant} stats streams open"))
        sub = self.gw.stats.subscribe(interval_class(interval_ms))

        async def push() -> None:
            try:
                with contextlib.suppress(_Gone):
                    while True:
                        await self.send_text(await sub.next())
            finally:
                self.gw.stats.unsubscribe(sub)

        self.stats_task = asyncio.ensure_future(push())

    def _unsubscribe(self) -> None:
        if self.stats_task is not None:
            self.stats_task.cancel()
            self.stats_task = None
            self.gw.stats_slots.give(self.tenant.name)

    async def _close_when_drained(self) -> None:
        """When the server drains, close with 1012 once this socket's requests have ended."""
        await self.gw.drain_started.wait()
        while self.streams:
            await asyncio.sleep(0.05)
        await self.close(Draining("server is shutting down"))

    # -- output ------------------------------------------------------------------------------
    async def send(self, payload: dict) -> None:
        """Send one frame; raises _Gone if the socket is closed or closing. Text that UTF-8
        cannot carry (a lone surrogate) is sent \\u-escaped instead of failing the frame."""
        text = json.dumps(payload, ensure_ascii=False)
        try:
            text.encode()
        except UnicodeEncodeError:
            text = json.dumps(payload)
        await self.send_text(text)

    async def send_text(self, text: str) -> None:
        async with self._send_lock:
            if self.ws.application_state is not WebSocketState.CONNECTED:
                raise _Gone()
            try:
                await self.ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError) as exc:
                raise _Gone() from exc

    async def send_error(self, cid, exc: GatewayError) -> None:
        error = exc.body()["error"]
        if exc.retry_after is not None:
            error["retry_after"] = round(exc.retry_after, 3)
        await self.send({"type": "error", "id": cid, "error": error})

    async def close(self, exc: GatewayError | None, reason: str = "") -> None:
        """Close with the error's close code (None: a normal closure, 1000)."""
        code = WS_NORMAL_CLOSURE if exc is None else exc.ws_close
        reason = reason if exc is None else exc.message
        if self.state is State.CLOSED:
            return
        self._to(State.CLOSED)
        log.info("ws.close", code=code, reason=reason)
        async with self._send_lock:
            if self.ws.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(RuntimeError, OSError):
                    await self.ws.close(code=code, reason=reason.encode()[:120].decode(errors="ignore"))


_evictions: set[asyncio.Task] = set()


class _Gone(Exception):
    """The socket is closed: stop sending on it."""


def _key(cid) -> str:
    return str(cid) if isinstance(cid, str) else f"#{cid}"


async def chat_socket(websocket: WebSocket) -> None:
    await Connection(websocket, websocket.app.state.gateway).serve()
