"""Running the app under uvicorn with a draining shutdown.

uvicorn's own SIGTERM handling stops at once: it closes the listening socket and cancels
WebSockets with 1012. `DrainingServer` first lets the gateway drain (new requests get 503
or close 1012, running streams finish for up to the grace period, the rest are aborted
with a final event), then lets uvicorn shut down. A second signal ends the streams at
once (still each with its final event); a third exits immediately.
"""

from __future__ import annotations

import asyncio

import structlog
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger("streamgate.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway):
        super().__init__(config)
        self.gateway = gateway
        self._drain_task: asyncio.Task | None = None
        self._signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """First signal: drain for the grace period. Second: end every stream now, each
        with its final `server_draining` event (a JSON 503 where headers were not sent
        yet), then exit without waiting for connections. Third: exit at once."""
        self._signals += 1
        log.info("signal.received", signal=int(sig), count=self._signals)
        if self._loop is None or self._signals > 2:
            self.force_exit = True
            self.should_exit = True
            return
        grace, force = (None, False) if self._signals == 1 else (0.0, True)
        self._loop.call_soon_threadsafe(self._start_drain, grace, force)

    def _start_drain(self, grace: float | None, force: bool) -> None:
        async def drain_then_exit() -> None:
            try:
                await self.gateway.drain(grace)
            finally:
                self.force_exit = self.force_exit or force
                self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head. uvicorn times out an
    idle keep-alive connection but not one that opens and never sends, or sends its
    headers a byte at a time: such a connection is closed `header_timeout` seconds after
    it opened (or after the first byte of its next request)."""

    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()                 # the first bytes of a next request on a kept-alive connection
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:     # a complete request head arrived
            self._disarm()

    def handle_websocket_upgrade(self, event) -> None:
        self._disarm()                  # the transport now belongs to the WebSocket protocol
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def config(app, host: str, port: int, *, max_frame_bytes: int, log_config=None, log_level=None,
           limit_concurrency: int | None = None, timeout_keep_alive: float = 5, timeout_headers: float = 10,
           ws_ping_interval: float | None = 20.0, ws_ping_timeout: float | None = 20.0) -> uvicorn.Config:
    """uvicorn's settings for the gateway. `limit_concurrency`: connections + tasks past
    which uvicorn answers 503 at once; `timeout_keep_alive`: seconds an idle keep-alive
    connection stays open; `timeout_headers`: seconds to send a request head;
    `ws_ping_*`: protocol pings that close dead WebSockets."""
    http = type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout": timeout_headers})
    extra = {} if log_level is None else {"log_level": log_level}
    return uvicorn.Config(app, host=host, port=port, http=http, ws="websockets-sansio", ws_max_size=max_frame_bytes,
                          log_config=log_config, timeout_graceful_shutdown=5, limit_concurrency=limit_concurrency,
                          timeout_keep_alive=timeout_keep_alive, ws_ping_interval=ws_ping_interval,
                          ws_ping_timeout=ws_ping_timeout, **extra)


def serve(app, host: str, port: int, **limits) -> None:
    """Run the app until a signal has drained it (`limits`: see `config`)."""
    DrainingServer(config(app, host, port, **limits), app.state.gateway).run()
