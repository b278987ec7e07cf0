"""A WebSocket's life before and around the chat protocol (gateway/ws.py): the Origin
check, the guarded state machine, the unauthenticated pool, authentication and the
socket caps, and sending frames that are always encodable.

States: CONNECTING → AUTHENTICATING → OPEN → CLOSED, changed only through `_to()`, which
raises on any other transition. A socket without an Authorization header waits among
the unauthenticated ones (their own small pool, `max_unauthenticated_sockets`) until it
authenticates; then it holds one place among the authenticated ones (`max_sockets`) and
one of its tenant's (`max_sockets_per_tenant`). Keyless sockets never take the places of
authenticated ones. Close codes come from the error classes (gateway/errors.py).
"""

from __future__ import annotations

import asyncio
import enum
import json
from urllib.parse import urlsplit

import structlog
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from .auth import authenticate
from .errors import WS_NORMAL_CLOSURE, AuthError, GatewayError, TooManyConnections
from .protocols import abort_transport

log = structlog.get_logger("streamgate.ws")

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


class Socket:
    def __init__(self, websocket: WebSocket, gw):
        self.ws = websocket
        self.gw = gw
        self.state = State.CONNECTING
        self.tenant = None
        self.places: list[str] = []         # what this socket holds in gw.sockets
        self.holds_address = False          # one of gw.pending_by_address's places for its address
        self._send_lock = asyncio.Lock()

    def _to(self, state: State) -> None:
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"illegal WebSocket transition {self.state.value} -> {state.value}")
        self.state = state

    def address(self) -> str:
        client = self.ws.client
        return client.host if client else ""

    async def _wait_in_pending(self) -> None:
        """Join the unauthenticated sockets; when they are at their cap, the one waiting
        longest is closed 1013 to make room, so keyless sockets can delay a newcomer's
        auth by at most one round of the pool, never lock it out. One client address
        holds at most `max_unauthenticated_sockets_per_address` of them: the HTTP protocol refuses
        the upgrade with a 429 past that (gateway/protocols.py); a socket that raced past
        that check is closed 1013 here."""
        settings = self.gw.settings
        if not self.gw.pending_by_address.take(self.address(), settings.max_unauthenticated_sockets_per_address):
            return await self.close(TooManyConnections("too many unauthenticated connections from your address"))
        self.holds_address = True
        pending = self.gw.pending_sockets       # insertion-ordered: oldest first
        if len(pending) >= settings.max_unauthenticated_sockets:
            oldest = next(iter(pending))
            del pending[oldest]
            evict = asyncio.ensure_future(oldest.close(TooManyConnections(
                "too many unauthenticated connections; this one waited longest without authenticating")))
            _evictions.add(evict)       # (a task needs a reference until it is done)
            evict.add_done_callback(_evictions.discard)
        pending[self] = None

    def leave_pending(self) -> None:
        self.gw.pending_sockets.pop(self, None)
        if self.holds_address:
            self.gw.pending_by_address.give(self.address())
            self.holds_address = False

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
        self.leave_pending()
        self.places = [AUTHENTICATED, per_tenant]
        self.tenant = tenant
        self._to(State.OPEN)
        await self.send({"type": "auth.ok", "tenant": tenant.name})
        return True

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
        """Raises _Gone if the socket is closed, or was aborted because this send stayed
        blocked for `write_timeout_s` (the client stopped reading)."""
        async with self._send_lock:
            if self.ws.application_state is not WebSocketState.CONNECTED:
                raise _Gone()
            # A timer, not wait_for: no task per frame. Aborting makes the blocked send raise.
            timer = asyncio.get_running_loop().call_later(self.gw.settings.write_timeout_s, self.abort)
            try:
                await self.ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError) as exc:
                raise _Gone() from exc
            finally:
                timer.cancel()

    def abort(self) -> None:
        """Drop the connection at once (a stuck write): the receive loop then sees the
        disconnect and `serve` releases everything the socket holds."""
        log.info("ws.write_deadline", timeout_s=self.gw.settings.write_timeout_s)
        if self.state is not State.CLOSED:
            self._to(State.CLOSED)
        abort_transport(self.ws.scope)

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
                try:
                    await asyncio.wait_for(self.ws.close(code=code, reason=reason.encode()[:120].decode(errors="ignore")),
                                           self.gw.settings.write_timeout_s)
                except asyncio.TimeoutError:
                    abort_transport(self.ws.scope)
                except (RuntimeError, OSError):
                    pass


_evictions: set[asyncio.Task] = set()


class _Gone(Exception):
    """The socket is closed: stop sending on it."""
