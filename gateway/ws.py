"""The WebSocket chat protocol at `/v1/chat/ws` (DESIGN.md, docs/PROTOCOL.md). This module
only adapts `ChatService` events to JSON frames; several requests share one socket,
told apart by the client's `id`. Admission of the socket itself (Origin, auth and its
deadline, the socket caps, the state machine) and frame output live in ws_socket.py.

Before `auth` (or a valid Authorization header) only `auth` and `ping` are allowed, and
only for `ws_auth_timeout_s`; a socket with no frame and nothing running for
`ws_idle_timeout_s` is closed 1000.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from starlette.websockets import WebSocket, WebSocketDisconnect

from .admission import Admission
from .auth import bearer_key
from .errors import (BadRequest, Draining, GatewayError, InternalError, PayloadTooLarge, PolicyViolation,
                     RateLimited, TooManyConnections)
from .limits import AddressRate
from .live import interval_class
from .schemas import timeout_from_field
from .sse import parse_json, refuse_lone_surrogates
from .streaming import Delta, Done
from .ws_format import WsFrames
from .ws_openai import KINDS as OPENAI_KINDS
from .ws_openai import admission_body, stream as stream_openai
from .ws_socket import Socket, State, _Gone, origin_allowed

log = structlog.get_logger("streamgate.ws")

MAX_ID_CHARS = 128


def valid_id(cid: object) -> bool:
    """A request id is a printable string of 1-128 characters (no lone surrogates, which
    no frame could carry) or an integer a JSON client can represent exactly."""
    if isinstance(cid, str):
        return 0 < len(cid) <= MAX_ID_CHARS and cid.isprintable()
    return isinstance(cid, int) and not isinstance(cid, bool) and abs(cid) < 2**53


class Connection(Socket):
    """The chat protocol on an admitted socket: requests, cancels, pings and stats."""

    def __init__(self, websocket: WebSocket, gw):
        super().__init__(websocket, gw)
        self.streams: dict[str, tuple[Admission, asyncio.Task]] = {}
        self.admitting = 0          # chat.requests being admitted (their prompt is being tokenized)
        self.stats_task: asyncio.Task | None = None
        self.stats_sub = None           # live.Subscriber of stats_task

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
            self.leave_pending()
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

    async def _receive_loop(self) -> None:
        settings, loop = self.gw.settings, asyncio.get_running_loop()
        auth_by = loop.time() + settings.ws_auth_timeout_s
        # Before auth a socket costs the server and names no one: small frames, few of them.
        preauth = AddressRate(settings.ws_preauth_frame_rate, settings.ws_preauth_frame_burst, clock=loop.time)
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
            if self.state is State.AUTHENTICATING:
                if len(text) > settings.ws_preauth_max_frame_bytes or \
                        len(text.encode()) > settings.ws_preauth_max_frame_bytes:
                    return await self.close(PayloadTooLarge(
                        f"a frame before authentication may be at most {settings.ws_preauth_max_frame_bytes} bytes"))
                if not preauth.admit(""):
                    return await self.close(PolicyViolation(
                        f"more than {settings.ws_preauth_frame_rate:g} frames per second before authenticating"))
            await self._handle(text)

    async def _handle(self, text: str) -> None:
        try:
            msg = parse_json(text, self.gw.settings.max_json_values, check_unicode=False)
        except BadRequest as exc:
            if exc.code != "invalid_json":
                return await self.send_error(None, exc)
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
        if isinstance(kind, str) and kind.endswith(".request") and kind[:-len(".request")] in OPENAI_KINDS:
            return await self._chat(msg, kind[:-len(".request")])       # completions, responses: ws_openai.py
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

    async def _chat(self, msg: dict, kind: str = "chat") -> None:
        cid = msg.get("id")
        if not valid_id(cid):
            return await self.send_error(None, BadRequest(
                f"id: a {kind}.request needs an id: a printable string of 1-{MAX_ID_CHARS} characters or an integer",
                param="id"))
        if _key(cid) in self.streams:
            return await self.send_error(cid, BadRequest(f"id: request {cid!r} is still running on this socket",
                                                         param="id", code="duplicate_id"))
        if len(self.streams) >= self.gw.settings.max_requests_per_socket:
            return await self.send_error(cid, RateLimited(
                f"at most {self.gw.settings.max_requests_per_socket} requests may run at once on one socket",
                reason="requests_per_socket", retry_after=None))
        body = {k: v for k, v in msg.items() if k not in ("type", "id", "stream", "stream_options", "timeout_s")}
        self.admitting += 1
        try:
            refuse_lone_surrogates(body)
            timeout_s = timeout_from_field(msg.get("timeout_s"))
            admit_kind, body, formatter = ("chat", body, None) if kind == "chat" else admission_body(kind, body)
            adm = await self.gw.chat.admit(self.tenant, body, transport="ws", timeout_s=timeout_s, kind=admit_kind)
        except GatewayError as exc:
            return await self.send_error(cid, exc)
        finally:
            self.admitting -= 1
        if self.state is State.CLOSED:      # the socket closed while the prompt was tokenized
            return self.gw.chat.release(adm)
        run = self._stream(cid, adm) if formatter is None else stream_openai(self, cid, adm, kind, formatter)
        self.streams[_key(cid)] = (adm, asyncio.ensure_future(run))

    async def _stream(self, cid, adm: Admission) -> None:
        events = self.gw.chat.run(adm)
        frames = WsFrames(self.gw, adm, cid)
        ended = False
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Delta):
                        for frame in frames.delta(event):
                            await self.send(frame)
                        continue
                    ended = True
                    if isinstance(event, Done):
                        for frame in frames.done(event):
                            await self.send(frame)
                    else:
                        await self.send_error(cid, event.error)
        except _Gone:
            pass        # the socket went away; aclosing ended the pipeline (abort + settle)
        except Exception as exc:
            await self.stream_fault(cid, adm, exc, ended)
        finally:
            self.streams.pop(_key(cid), None)

    async def stream_fault(self, cid, adm: Admission, exc: Exception, ended: bool) -> None:
        """A request's stream failed inside the gateway (chat here, and ws_openai's): logged, and
        its one terminal frame, an error, sent unless it had one already or the socket is gone."""
        log.error("ws.stream_fault", completion_id=adm.request_id, error=type(exc).__name__)
        if not ended:
            with contextlib.suppress(_Gone):
                await self.send_error(cid, InternalError("the request failed inside the gateway"))

    async def _subscribe(self, interval_ms) -> None:
        """One subscription per socket; it holds one of the tenant's stats places. The
        subscription is released here and in `_unsubscribe`, never in the push task's
        `finally`: a task cancelled before it first runs (Python >= 3.12 runs pipelined
        frames without yielding in between) never reaches its `try`."""
        if self.stats_task is not None:
            self._stop_push()               # a new interval: the place is kept
        elif not self.gw.stats_slots.take(self.tenant.name, self.gw.settings.max_stats_streams_per_tenant):
            return await self.send_error(None, TooManyConnections(
                f"tenant {self.tenant.name!r} has {self.gw.settings.max_stats_streams_per_tenant} stats streams open"))
        sub = self.gw.stats.subscribe(interval_class(interval_ms))

        async def push() -> None:
            with contextlib.suppress(_Gone):
                while True:
                    await self.send_text(await sub.next())

        self.stats_sub = sub
        self.stats_task = asyncio.ensure_future(push())

    def _stop_push(self) -> None:
        self.stats_task.cancel()
        self.stats_task = None
        if self.stats_sub is not None:
            self.gw.stats.unsubscribe(self.stats_sub)
            self.stats_sub = None

    def _unsubscribe(self) -> None:
        if self.stats_task is not None:
            self._stop_push()
            self.gw.stats_slots.give(self.tenant.name)

    async def _close_when_drained(self) -> None:
        """When the server drains, close with 1012 once this socket's requests have ended."""
        await self.gw.drain_started.wait()
        while self.streams or self.admitting:
            await asyncio.sleep(0.05)
        await self.close(Draining("server is shutting down"))

def _key(cid) -> str:
    return str(cid)


async def chat_socket(websocket: WebSocket) -> None:
    await Connection(websocket, websocket.app.state.gateway).serve()
