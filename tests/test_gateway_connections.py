"""Limits that refuse a connection or a body before it costs the event loop real work,
against a real uvicorn on 127.0.0.1 with a tiny model: keyless WebSocket upgrades per
address (refused inside the HTTP protocol), authenticating sockets per address (refused
before the upgrade), the body read deadline and the JSON value bound."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import time

import httpx
import pytest
import websockets

from gateway.limits import AddressRate
from tests.live import KEYS, FakeClock, serve, wait_until

AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}
HELLO = [{"role": "user", "content": "Hello there"}]


async def recv(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout=30))


def refused_status(exc: pytest.ExceptionInfo) -> tuple[int, dict]:
    response = exc.value.response
    return response.status_code, json.loads(response.body)


def test_address_rate_gives_a_burst_then_its_rate_and_forgets_full_buckets():
    """A bucket admits `burst` at once, then one per 1/rate seconds; addresses are
    independent; once the table passes its bound, buckets that refilled are dropped."""
    clock = FakeClock()
    rate = AddressRate(2.0, 3, clock=clock, max_addresses=4)
    assert [rate.admit("a") for _ in range(4)] == [True, True, True, False]
    assert rate.admit("b")
    clock.advance(0.5)
    assert rate.admit("a") and not rate.admit("a")
    clock.advance(10)                   # a and b are full again
    for i in range(3):
        assert rate.admit(f"c{i}")
    assert set(rate.buckets) == {"c0", "c1", "c2"}
    for i in range(3, 12):
        assert rate.admit(f"c{i}")      # nothing is full: the table grows, swept only when doubled
    assert len(rate.buckets) == 12 and rate.sweep_at >= 8


def has_httptools() -> bool:
    return importlib.util.find_spec("httptools") is not None


@pytest.mark.parametrize("http", ["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    not has_httptools(), reason="httptools is not installed in this environment (pip install -e .)"))])
async def test_keyless_upgrades_past_the_address_rate_get_a_429_before_the_handshake(tiny_model, tmp_path, http):
    """Past --ws-keyless-burst keyless upgrades from one address, the next gets HTTP 429
    too_many_connections (no WebSocket handshake), with either HTTP parser, also when it
    sends a made-up key; a socket sending a valid key in the header still connects."""
    limits = {"ws_keyless_rate": 0.01, "ws_keyless_burst": 2, "http": http}
    with serve(tiny_model("llama"), tmp_path, uvicorn_limits=limits) as live:
        first = [await websockets.connect(live.ws_url) for _ in range(2)]
        with pytest.raises(websockets.InvalidStatus) as exc:
            await websockets.connect(live.ws_url)
        status, body = refused_status(exc)
        assert status == 429 and body["error"]["code"] == "too_many_connections"
        assert exc.value.response.headers["retry-after"] == "1"
        async with websockets.connect(live.ws_url, additional_headers=AUTH) as keyed:
            assert (await recv(keyed))["type"] == "auth.ok"
        with pytest.raises(websockets.InvalidStatus) as exc:     # a made-up key buys no handshake
            await websockets.connect(live.ws_url, additional_headers={"Authorization": "Bearer sk-made-up"})
        assert refused_status(exc)[0] == 429
        for ws in first:
            await ws.close()


async def test_authenticating_sockets_per_address_are_capped_before_the_upgrade(tiny_model, tmp_path):
    """A client address holds at most max_unauthenticated_sockets_per_address sockets that
    have not authenticated; the next is refused with an HTTP 429 in OpenAI's shape; once
    one authenticates, its place is free again."""
    with serve(tiny_model("llama"), tmp_path, max_unauthenticated_sockets_per_address=2,
               uvicorn_limits={"ws_keyless_rate": 0}) as live:
        a, b = await websockets.connect(live.ws_url), await websockets.connect(live.ws_url)
        assert wait_until(lambda: live.gateway.pending_by_address["127.0.0.1"] == 2)
        with pytest.raises(websockets.InvalidStatus) as exc:
            await websockets.connect(live.ws_url)
        status, body = refused_status(exc)
        assert status == 429 and body["error"]["code"] == "too_many_connections"
        await a.send(json.dumps({"type": "auth", "api_key": KEYS["acme"]}))
        assert (await recv(a))["type"] == "auth.ok"
        c = await websockets.connect(live.ws_url)
        await c.send(json.dumps({"type": "ping"}))
        assert await recv(c) == {"type": "pong"}
        for ws in (a, b, c):
            await ws.close()
        assert wait_until(lambda: live.gateway.pending_by_address["127.0.0.1"] == 0)


def test_a_body_that_trickles_past_the_body_timeout_gets_a_408(tiny_model, tmp_path):
    """A client that sends its head but not its whole body within body_timeout_s gets 408
    request_timeout in OpenAI's shape and the connection closes; a normal request still works."""
    with serve(tiny_model("llama"), tmp_path, body_timeout_s=0.5) as live:
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + KEYS["acme"].encode() + b"\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"messages\": ")
            s.settimeout(10)
            t0, answer = time.monotonic(), b""
            while chunk := s.recv(4096):
                answer += chunk
            assert time.monotonic() - t0 < 5
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert json.loads(body)["error"]["code"] == "request_timeout"
        r = httpx.post(f"{live.url}/v1/chat/completions", headers=AUTH, json={"messages": HELLO, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200


async def test_a_document_with_too_many_json_values_is_refused_before_decoding(tiny_model, tmp_path):
    """A body or frame with more commas and brackets than max_json_values is a 400
    too_many_json_values (HTTP) or an error event on a socket that stays usable."""
    with serve(tiny_model("llama"), tmp_path, max_json_values=1000) as live:
        dense = json.dumps({"messages": HELLO, "stop": [""] * 2000})
        r = httpx.post(f"{live.url}/v1/chat/completions", headers=AUTH, content=dense, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_json_values"
        async with websockets.connect(live.ws_url, additional_headers=AUTH) as ws:
            assert (await recv(ws))["type"] == "auth.ok"
            await ws.send(json.dumps({"type": "chat.request", "id": "x", "messages": HELLO, "stop": [""] * 2000}))
            err = await recv(ws)
            assert err["type"] == "error" and err["error"]["code"] == "too_many_json_values"
            await ws.send(json.dumps({"type": "ping"}))
            assert await recv(ws) == {"type": "pong"}


async def test_refusals_are_logged_as_one_counted_line_per_interval():
    """429 answers on a path are logged at once for the first, then as one counted
    `http.refused` line per interval, and none are lost when the flood stops."""
    from gateway.logs import RefusalLog

    class Lines:
        def __init__(self):
            self.lines = []

        def info(self, event, **kw):
            self.lines.append((event, kw["path"], kw["count"]))

    log = Lines()
    refusals = RefusalLog(log, every_s=0.05)
    for _ in range(300):
        refusals.add("/v1/stats")
    refusals.add("/v1/chat/completions")
    assert log.lines == [("http.refused", "/v1/stats", 1), ("http.refused", "/v1/chat/completions", 1)]
    await asyncio.sleep(0.2)
    assert log.lines[2:] == [("http.refused", "/v1/stats", 299)]
    assert not refusals.timers


def test_serve_flags_reach_uvicorn():
    """The uvicorn-facing `serve` flags end up in uvicorn's config and the protocol class."""
    import argparse

    from starlette.applications import Starlette

    from gateway.cli import _limit_args, server_limits
    from gateway.server import config

    p = argparse.ArgumentParser()
    _limit_args(p)
    args = p.parse_args(["--loop", "asyncio", "--http", "h11", "--backlog", "128", "--ws-keyless-rate", "3",
                         "--ws-keyless-burst", "5", "--timeout-headers", "2.5", "--switch-interval-ms", "1"])
    limits = server_limits(args)
    assert limits.pop("switch_interval_ms") == 1.0
    cfg = config(Starlette(), "127.0.0.1", 0, **limits)
    assert (cfg.loop, cfg.backlog) == ("asyncio", 128)
    assert cfg.http.__name__ == "DefendedH11Protocol" and cfg.http.header_timeout == 2.5
    assert (cfg.http.keyless_upgrades.rate, cfg.http.keyless_upgrades.burst) == (3.0, 5)
    off = config(Starlette(), "127.0.0.1", 0, **{**limits, "ws_keyless_rate": 0})
    assert off.http.keyless_upgrades is None
