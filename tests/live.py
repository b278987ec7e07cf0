"""A real uvicorn on 127.0.0.1 (port 0) in a background thread, serving the real app.

Streaming, time to first token and disconnects are only honest over a socket: test
transports buffer whole responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time

import httpx

from engine import EngineConfig
from gateway.app import GatewaySettings, create_app
from gateway.server import DrainingServer
from gateway.server import config as server_config
from tenants import Ledger, QuotaManager, Registry, hash_key

KEYS = {"acme": "sk-acme-test", "other": "sk-other-test", "batch": "sk-batch-test"}


def tenants(**overrides: dict) -> Registry:
    """acme (class 0), other (class 0) and batch (class 2), generous limits unless overridden."""
    base = {name: {"api_key_sha256": [hash_key(key)], "priority": 2 if name == "batch" else 0}
            for name, key in KEYS.items()}
    for name, extra in overrides.items():
        base[name].update(extra)
    return Registry.from_dict({"tenants": base})


class FakeClock:
    """Monotonic and wall clocks that only move when told."""

    def __init__(self, start: float = 1_000.0, wall: float = 1_800_000_000.0):
        self.now, self.wall_now = start, wall

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall_now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall_now += seconds


class LiveServer:
    def __init__(self, app, **uvicorn_limits):
        self.app = app
        self.gateway = app.state.gateway
        cfg = server_config(app, "127.0.0.1", 0, max_frame_bytes=self.gateway.settings.max_frame_bytes,
                            log_level="warning", **uvicorn_limits)
        self.server = DrainingServer(cfg, self.gateway)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, ready: bool = True) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.ws_url = f"ws://127.0.0.1:{port}/v1/chat/ws"
        if ready:
            while httpx.get(f"{self.url}/health").status_code != 200:
                assert time.monotonic() < deadline, "the engine did not become ready"
                time.sleep(0.02)
        return self

    def sigterm(self) -> None:
        """What a SIGTERM does: the server's signal handler, called from another thread."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not stop"

    def call(self, fn, *args):
        """Run a coroutine function on the server's event loop and wait for its result."""
        loop = self.server._loop
        return asyncio.run_coroutine_threadsafe(fn(*args), loop).result(timeout=30)

    def engine_stats(self) -> dict:
        """A fresh engine snapshot in the wire format (as /v1/stats sends it)."""
        async def stats():
            return (await self.gateway.engine.stats()).as_dict()
        return self.call(stats)


def engine_config(model_dir: str, **kw) -> EngineConfig:
    return EngineConfig(model=model_dir, **{"max_num_seqs": 8, "max_num_batched_tokens": 256,
                                            "num_kv_blocks": 128, **kw})


@contextlib.contextmanager
def serve(model_dir: str, tmp_path, *, registry: Registry | None = None, quotas: QuotaManager | None = None,
          ledger_path=None, engine=None, ready: bool = True, engine_kw: dict | None = None,
          uvicorn_limits: dict | None = None, **settings):
    """Start a gateway on a real uvicorn and stop it afterwards (`uvicorn_limits`: see
    gateway.server.config)."""
    cfg = engine_config(model_dir, **(engine_kw or {}))
    s = GatewaySettings(engine=cfg, ledger_path=str(ledger_path or tmp_path / "usage.sqlite3"),
                        model_name="tiny", **settings)
    app = create_app(s, engine=engine, registry=registry or tenants(), quotas=quotas)
    live = LiveServer(app, **(uvicorn_limits or {})).start(ready=ready)
    try:
        yield live
        if live.thread.is_alive() and not live.server.should_exit:
            from tests.idle import assert_idle

            assert_idle(live)       # every counter and registry back to idle (tests/idle.py)
    finally:
        if live.thread.is_alive():
            live.stop()


def fake_quotas(clock: FakeClock, path) -> QuotaManager:
    return QuotaManager(Ledger(path, clock=clock.wall), clock=clock)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
