"""The write deadline on every HTTP response (docs/PROTOCOL.md, "Limits"): a send that
stays blocked for `timeout_s` (the client stopped reading, the socket's buffers are full)
aborts the connection, dropping its unsent buffer (`close()` would wait for a reader that
never comes). uvicorn then answers every later send at once and reports the disconnect,
so the response (an SSE stream, a large JSON body) ends through its normal path and
whatever it holds is released and settled. WebSocket frames have the same deadline in
gateway/ws_socket.py."""

from __future__ import annotations

import asyncio

import structlog

from .protocols import TRANSPORT_KEY, abort_transport

log = structlog.get_logger("streamgate.http")


class WriteTimeout(Exception):
    """A send passed its deadline and there was no transport to abort (another server)."""


def deadline_send(scope, send, timeout_s: float):
    """`send` under the deadline. With the connection's transport in the scope (our
    protocol puts it there) a timer aborts it, which costs no task per send (an SSE
    stream sends one message per delta); otherwise the send is cancelled and raises."""
    if TRANSPORT_KEY not in scope:
        async def send_or_raise(message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout_s)
            except asyncio.TimeoutError:
                raise WriteTimeout(f"a send blocked for {timeout_s:g} s") from None
        return send_or_raise

    loop = asyncio.get_running_loop()

    def expire() -> None:
        log.info("write.deadline", timeout_s=timeout_s)
        abort_transport(scope)          # the blocked send then returns: uvicorn sees the disconnect

    async def send_by_deadline(message) -> None:
        timer = loop.call_later(timeout_s, expire)
        try:
            await send(message)
        finally:
            timer.cancel()

    return send_by_deadline


class WriteDeadline:
    def __init__(self, app, timeout_s: float | None):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.timeout_s:
            send = deadline_send(scope, send, self.timeout_s)
        await self.app(scope, receive, send)
