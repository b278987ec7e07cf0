"""Running the app under uvicorn with a draining shutdown.

uvicorn's own SIGTERM handling stops at once: it closes the listening socket and cancels
WebSockets with 1012. `DrainingServer` first lets the gateway drain (new requests get 503
or close 1012, running streams finish for up to the grace period, the rest are aborted
with a final event), then lets uvicorn shut down. A second signal ends the streams at
once (still each with its final event); a third exits immediately.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import sys

import structlog
import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol   # config()'s ws

from .protocols import protocol_class

log = structlog.get_logger("streamgate.server")

CLOSE_ECHO_WAIT_S = 5.0      # draining: at most this long for closed WebSockets' echoes


def freeze_heap() -> int:
    """Collect, then move every object alive into the GC's permanent generation, which its
    collections skip (vLLM's engine does the same once started: `freeze_gc_heap`), and hand the
    memory loading freed back to the OS (glibc's malloc_trim); returns how many objects froze.
    Why: a served process holds ~400,000 objects once the model and the libraries are loaded,
    and a full collection scans them all, holding the GIL, so the event loop and the
    engine thread wait it out. 40 s of 8 streams (Zen 4 host, 2026-12-06) ran one full
    collection: 310 ms, against 1.6 ms frozen (244 ms against 0.01 ms in a loaded process, by
    hand). For the process that serves: objects frozen are never collected, so not for a
    process that builds engines and drops them (tests). The trim: loading frees the packing's
    first copies and the checkpoint's tensors, and glibc keeps most of it; a served SmolLM2 held
    1,233 MB after start-up without it and 771 MB with it (int8 weights: 1,198 against 626)."""
    gc.collect()
    gc.freeze()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)     # glibc: hand loading's freed heap back
    if trim is not None:
        trim(0)
    return gc.get_freeze_count()


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
        grace_s = self.gateway.settings.drain_grace_s if grace is None else grace

        async def drain_then_exit() -> None:
            try:
                await self.gateway.drain(grace_s)
                await self._closing_handshakes(grace_s)
            finally:
                self.force_exit = self.force_exit or force
                self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())

    async def _closing_handshakes(self, grace: float) -> None:
        """Wait, within the grace and CLOSE_ECHO_WAIT_S, for every WebSocket to end: the
        gateway closes each with 1012 as its requests end, and its connection ends when the
        client's close echo arrives (or uvicorn's close timeout passes). uvicorn's shutdown
        closes every transport at once: a client whose echo was still on its way found the
        connection cut, and a browser then reports 1006, not the 1012 it was sent."""
        loop = asyncio.get_running_loop()
        until = loop.time() + min(grace, CLOSE_ECHO_WAIT_S)
        while loop.time() < until and any(isinstance(c, WebSocketsSansIOProtocol) for c in self.server_state.connections):
            await asyncio.sleep(0.02)       # each leaves the set in its connection_lost


def config(app, host: str, port: int, *, max_frame_bytes: int, log_config=None, log_level=None,
           limit_concurrency: int | None = None, timeout_keep_alive: float = 5, timeout_headers: float = 10,
           ws_ping_interval: float | None = 20.0, ws_ping_timeout: float | None = 20.0, loop: str = "auto",
           http: str = "auto", backlog: int = 2048, ws_keyless_rate: float = 10.0,
           ws_keyless_burst: int = 16, ws_keyed_rate: float = 20.0, ws_keyed_burst: int = 40,
           ws_compression_max_bytes: int = 0, max_connections_per_address: int = 256) -> uvicorn.Config:
    """uvicorn's settings for the gateway. `limit_concurrency`: connections + tasks past
    which uvicorn answers 503 at once; `timeout_keep_alive`: seconds an idle keep-alive
    connection stays open; `timeout_headers`: seconds to send a request head;
    `ws_ping_*`: protocol pings that close dead WebSockets; `loop` / `http`: uvicorn's
    event loop (auto, asyncio, uvloop) and HTTP parser (auto, h11, httptools);
    `backlog`: the listen queue; `ws_keyless_*`: WebSocket upgrades without a key per
    client address and second, and at once (gateway/protocols.py; rate 0: no limit);
    `ws_keyed_*`: WebSocket upgrades with a valid key per tenant and second, and at once;
    `max_connections_per_address`: open HTTP connections from one client address past
    which a new one gets a static 429 from the protocol (0: no cap; behind a proxy every
    client shares its address);
    `ws_compression_max_bytes`: 0 (default) never negotiates permessage-deflate, so every
    byte limit counts the bytes processed; above 0 it is negotiated and no message may
    inflate past this many bytes (nor past `max_frame_bytes`: websockets enforces its
    max_size on the decompressed message)."""
    gateway = getattr(app.state, "gateway", None)
    protocol = protocol_class(http, header_timeout=timeout_headers, keyless_rate=ws_keyless_rate,
                              keyless_burst=ws_keyless_burst,
                              address_full=None if gateway is None else gateway.unauthenticated_full,
                              known_key=None if gateway is None else gateway.known_key,
                              keyed_rate=ws_keyed_rate, keyed_burst=ws_keyed_burst,
                              tenant_full=None if gateway is None else gateway.tenant_sockets_full,
                              max_per_address=max_connections_per_address)
    extra = {} if log_level is None else {"log_level": log_level}
    inflated = min(max_frame_bytes, ws_compression_max_bytes) if ws_compression_max_bytes > 0 else max_frame_bytes
    return uvicorn.Config(app, host=host, port=port, loop=loop, http=protocol, ws="websockets-sansio",
                          ws_max_size=inflated, ws_per_message_deflate=ws_compression_max_bytes > 0, log_config=log_config, timeout_graceful_shutdown=5,
                          limit_concurrency=limit_concurrency, timeout_keep_alive=timeout_keep_alive,
                          ws_ping_interval=ws_ping_interval, ws_ping_timeout=ws_ping_timeout, backlog=backlog,
                          **extra)


def serve(app, host: str, port: int, *, switch_interval_ms: float | None = None, **limits) -> None:
    """Run the app until a signal has drained it (`limits`: see `config`).
    `switch_interval_ms`: the interpreter's GIL switch interval (None: Python's 5 ms)."""
    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1000)
    DrainingServer(config(app, host, port, **limits), app.state.gateway).run()
