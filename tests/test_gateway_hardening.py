"""Issue 25 regressions against a real uvicorn on 127.0.0.1: a HEAD that leaked a stats
subscriber, compressed frames that defeated the byte limits, clients that stop reading,
lone surrogates, pipelined stats frames. The engine is the fake FloodEngine (these are
transport tests: it fills a socket's buffers as fast as the loop allows, on any host)."""

from __future__ import annotations

import asyncio
import json
import socket
import zlib

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tests.fake_engine import FloodEngine
from tests.idle import assert_idle, held, idle_after  # noqa: F401 - fixture
from tests.live import KEYS, serve, tenants, wait_until

pytestmark = pytest.mark.usefixtures("idle_after")

AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with serve("fake", tmp_path_factory.mktemp("hard"), engine=FloodEngine(), write_timeout_s=0.5,
               registry=tenants(batch={"requests_per_minute": 1}),
               ws_preauth_frame_rate=5.0, ws_preauth_frame_burst=10, max_stats_streams_per_tenant=2) as server:
        yield server


async def recv(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout=30))


async def authed(live, key=KEYS["acme"], **kw):
    ws = await websockets.connect(live.ws_url, **kw)
    await ws.send(json.dumps({"type": "auth", "api_key": key}))
    assert (await recv(ws))["type"] == "auth.ok"
    return ws


async def closed_with(ws) -> int:
    with pytest.raises(ConnectionClosed):
        for _ in range(100):
            await asyncio.wait_for(ws.recv(), timeout=30)
    return ws.close_code


# -- 1: HEAD ----------------------------------------------------------------------------------
def test_head_on_stats_holds_nothing_afterwards(live):
    """HEAD /v1/stats (Starlette answers HEAD on GET routes, and never starts the body)
    leaves no subscriber and no place behind, however many are sent."""
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=30) as client:
        for _ in range(30):
            assert client.head("/v1/stats").status_code == 200
    assert_idle(live)
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=30) as client, \
            client.stream("GET", "/v1/stats?interval_ms=100") as r:     # the places all came back
        assert r.status_code == 200
        assert json.loads(next(line for line in r.iter_lines() if line.startswith("data:"))[5:])["type"] == "stats"


# -- 2: compression and frames before auth ---------------------------------------------------
def test_permessage_deflate_is_not_negotiated_by_default(live):
    """A client that offers permessage-deflate (websockets does by default) gets none:
    every frame limit then counts the bytes the server actually processes."""
    async def main():
        ws = await websockets.connect(live.ws_url)
        assert ws.protocol.extensions == []
        await ws.send(json.dumps({"type": "ping"}))
        assert (await recv(ws))["type"] == "pong"
        await ws.close()
    asyncio.run(main())


def test_frames_before_auth_are_small_and_few(live):
    """Before auth a frame over ws_preauth_max_frame_bytes is closed 1009 and more frames
    than the per-socket rate are closed 1008; after auth neither limit applies."""
    async def main():
        ws = await websockets.connect(live.ws_url)
        await ws.send(json.dumps({"type": "ping", "pad": [0] * 3000}))
        assert await closed_with(ws) == 1009
        ws = await websockets.connect(live.ws_url)
        for _ in range(40):
            await ws.send(json.dumps({"type": "ping"}))
        assert await closed_with(ws) == 1008
        ws = await authed(live)
        for _ in range(40):
            await ws.send(json.dumps({"type": "ping", "pad": [0] * 3000}))
        assert [(await recv(ws))["type"] for _ in range(40)] == ["pong"] * 40
        await ws.close()
    asyncio.run(main())


def test_compression_when_enabled_caps_the_inflated_size(tmp_path):
    """--ws-compression-max-bytes turns permessage-deflate on; a message that inflates
    past the cap is closed 1009 however small it was on the wire."""
    with serve("fake", tmp_path, engine=FloodEngine(), uvicorn_limits={"ws_compression_max_bytes": 8192}) as live:
        async def main():
            ws = await authed(live)
            assert [e.name for e in ws.protocol.extensions] == ["permessage-deflate"]
            await ws.send(json.dumps({"type": "ping"}))
            assert (await recv(ws))["type"] == "pong"
            bomb = json.dumps({"type": "ping", "pad": [0] * 50_000})       # ~100 KB, ~200 B deflated
            assert len(zlib.compress(bomb.encode())) < 1000
            await ws.send(bomb)
            assert await closed_with(ws) == 1009
        asyncio.run(main())
        assert_idle(live)


# -- 3: clients that stop reading --------------------------------------------------------------
def _stuck_sse_client(live) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps({"messages": HELLO, "stream": True, "max_tokens": 1_000_000}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + KEYS["acme"].encode() + b"\r\ncontent-length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


def _read_to_end(sock: socket.socket) -> None:
    sock.settimeout(30)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    sock.close()


def test_an_sse_client_that_stops_reading_is_cut_off_and_settled(live):
    """A streaming client that never reads again: its send blocks, passes the write
    deadline, the connection is aborted, and the stream, its slot and its lease are
    released and billed (nothing waits for a reader that never comes)."""
    billed = live.gateway.ledger.used_today("acme")
    sock = _stuck_sse_client(live)
    assert_idle(live)
    _read_to_end(sock)          # the server dropped it: what was buffered, then EOF or a reset
    assert live.gateway.ledger.used_today("acme") > billed


def test_a_websocket_that_stops_reading_is_aborted_and_released(live):
    """Same on a WebSocket: the frame send passes its deadline, the socket is aborted and
    its stream, stats subscription, socket places and lease come back."""
    async def main():
        ws = await authed(live, max_queue=1)
        await ws.send(json.dumps({"type": "stats.subscribe", "interval_ms": 100}))
        await ws.send(json.dumps({"type": "chat.request", "id": 1, "messages": HELLO, "max_tokens": 1_000_000}))
        await asyncio.to_thread(assert_idle, live)
        with pytest.raises(ConnectionClosed):      # what was buffered, then the abort
            while True:
                await asyncio.wait_for(ws.recv(), 30)
    asyncio.run(main())


# -- 4: pipelined stats frames ---------------------------------------------------------------
def test_pipelined_subscribe_unsubscribe_leaves_no_subscriber(live):
    """stats.subscribe / stats.unsubscribe pipelined in one burst: every subscription is
    released by its owner (on Python >= 3.12 a push task can be cancelled before it runs)."""
    async def main():
        ws = await authed(live)
        frames = [json.dumps({"type": t}) for _ in range(300) for t in ("stats.subscribe", "stats.unsubscribe")]
        await ws.send(json.dumps({"type": "ping"}))
        for frame in frames:
            await ws.send(frame)
        await ws.send(json.dumps({"type": "ping"}))
        assert (await recv(ws))["type"] == "pong"
        while (await recv(ws))["type"] != "pong":
            pass
        assert held(live)["stats.subscribers"] == 0
        await ws.close()
    asyncio.run(main())


# -- 5: lone surrogates ----------------------------------------------------------------------
def test_a_lone_surrogate_is_a_400_naming_the_field(live):
    body = '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    r = httpx.post(f"{live.url}/v1/chat/completions", content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.content" and r.json()["error"]["code"] == "invalid_unicode"
    pair = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'     # a valid pair
    r = httpx.post(f"{live.url}/v1/chat/completions", content=pair, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_lone_surrogate_on_a_websocket_fails_only_its_request(live):
    """A chat.request with a lone surrogate is an error frame for its id; the socket and
    its other requests carry on. An auth frame with one is an invalid key: 1008."""
    async def main():
        ws = await authed(live)
        await ws.send('{"type": "chat.request", "id": 1, "messages": [{"role": "user", "content": "\\udc00"}]}')
        err = await recv(ws)
        assert err["type"] == "error" and err["error"]["code"] == "invalid_unicode"
        await ws.send(json.dumps({"type": "chat.request", "id": 2, "messages": HELLO, "max_tokens": 2}))
        kinds = []
        while not kinds or kinds[-1] != "chat.done":
            kinds.append((await recv(ws))["type"])
        await ws.close()
        ws = await websockets.connect(live.ws_url)
        await ws.send('{"type": "auth", "api_key": "sk-\\ud800"}')
        assert await closed_with(ws) == 1008
    asyncio.run(main())


# -- 7: the quota before any work on the body ----------------------------------------------------
def test_a_tenant_over_its_limits_is_refused_before_its_body_is_read(live):
    """With its requests per minute used up, a tenant's next request is a 429 answered
    from its headers alone: the server neither waits for nor parses its (large) body."""
    ok = httpx.post(f"{live.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['batch']}"},
                    json={"messages": HELLO, "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer " + KEYS["batch"].encode() + b"\r\ncontent-length: 900000\r\n\r\n")
        sock.settimeout(10)         # the body timeout is 30 s: before, the answer waited for the body
        head = b""
        while b"requests_per_minute" not in head and (chunk := sock.recv(4096)):
            head += chunk
    assert head.startswith(b"HTTP/1.1 429"), head[:200]
    assert b"requests_per_minute" in head


# -- 10: keyed upgrades ------------------------------------------------------------------------
def test_keyed_upgrades_are_refused_before_the_handshake_when_the_tenant_is_full_or_too_fast(tmp_path):
    """An upgrade carrying a valid key gets HTTP 429 before any handshake when its tenant's
    socket places are all taken, or past its tenant's upgrade rate; others are unaffected."""
    from websockets.exceptions import InvalidStatus

    limits = {"ws_keyed_rate": 0.01, "ws_keyed_burst": 3}
    with serve("fake", tmp_path, engine=FloodEngine(), max_sockets_per_tenant=2, uvicorn_limits=limits) as live:
        async def main():
            held_open = [await websockets.connect(live.ws_url, additional_headers=AUTH) for _ in range(2)]
            for ws in held_open:
                assert (await recv(ws))["type"] == "auth.ok"
            with pytest.raises(InvalidStatus) as full:
                await websockets.connect(live.ws_url, additional_headers=AUTH)
            assert full.value.response.status_code == 429
            for ws in held_open:
                await ws.close()
            await asyncio.to_thread(assert_idle, live)
            ok = await websockets.connect(live.ws_url, additional_headers=AUTH)    # the 3rd of the burst (a refused one takes none)
            await ok.close()
            with pytest.raises(InvalidStatus) as fast:                              # the 4th: over the rate
                await websockets.connect(live.ws_url, additional_headers=AUTH)
            assert fast.value.response.status_code == 429
            other = await websockets.connect(live.ws_url, additional_headers={"Authorization": f"Bearer {KEYS['other']}"})
            assert (await recv(other))["type"] == "auth.ok"
            await other.close()
        asyncio.run(main())
        assert_idle(live)


# -- 11: /metrics ------------------------------------------------------------------------------
def test_metrics_need_the_token_when_one_is_set(tmp_path):
    """/metrics names every tenant: with --metrics-token it answers only that bearer token."""
    with serve("fake", tmp_path, engine=FloodEngine(), metrics_token="m-secret") as live:
        assert httpx.get(f"{live.url}/metrics").status_code == 403
        assert httpx.get(f"{live.url}/metrics", headers=AUTH).status_code == 403        # a tenant key is not it
        r = httpx.get(f"{live.url}/metrics", headers={"Authorization": "Bearer m-secret"})
        assert r.status_code == 200 and "streamgate_gateway_requests" in r.text


def test_metrics_without_a_token_answer_only_loopback_clients():
    from types import SimpleNamespace

    from gateway.metrics import metrics_allowed

    def request(host):
        return SimpleNamespace(client=SimpleNamespace(host=host), headers={})
    assert metrics_allowed(request("127.0.0.1"), None) and metrics_allowed(request("::1"), None)
    assert not metrics_allowed(request("10.0.0.7"), None) and not metrics_allowed(request("203.0.113.5"), None)


def test_a_loopback_server_answers_only_its_own_host_names(tmp_path):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 is same-origin with itself,
    so Origin cannot tell; the Host allowlist (serve's default on loopback) refuses it, on
    HTTP (421) and on the WebSocket upgrade (403)."""
    import argparse

    from gateway.cli_limits import allowed_hosts
    from websockets.exceptions import InvalidStatus

    hosts = allowed_hosts(argparse.Namespace(host="127.0.0.1", allow_host=[]))
    assert set(hosts) == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts(argparse.Namespace(host="0.0.0.0", allow_host=[])) == ()
    with serve("fake", tmp_path, engine=FloodEngine(), allowed_hosts=hosts) as live:
        port = live.url.rsplit(":", 1)[1]
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert httpx.get(f"{live.url}/health", headers={"host": f"localhost:{port}"}).status_code == 200
        evil = {"host": f"rebind.example:{port}", "origin": f"http://rebind.example:{port}"}
        r = httpx.post(f"{live.url}/v1/chat/completions", headers={**evil, **AUTH},
                       json={"messages": HELLO, "max_tokens": 1})
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"

        async def main():
            with pytest.raises(InvalidStatus) as refused:
                await websockets.connect(live.ws_url, additional_headers={"Host": evil["host"],
                                                                          "Origin": evil["origin"]})
            assert refused.value.response.status_code == 403
        asyncio.run(main())
        assert_idle(live)


def test_open_connections_per_address_are_capped(tmp_path):
    """Past --max-connections-per-address open connections from one address, a new one
    gets a static 429 and is closed; once one closes, a new one is served. A connection
    that became a WebSocket no longer counts (the socket pools do)."""
    with serve("fake", tmp_path, engine=FloodEngine(), uvicorn_limits={"max_connections_per_address": 3}) as live:
        host, port = live.url.removeprefix("http://").split(":")
        held_open = [socket.create_connection((host, int(port))) for _ in range(3)]
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(10)
        assert extra.recv(4096).startswith(b"HTTP/1.1 429")
        extra.close()
        held_open.pop().close()

        def served() -> bool:
            with httpx.Client() as client:
                return client.get(f"{live.url}/health").status_code == 200
        assert wait_until(served)
        for sock in held_open:
            sock.close()

        async def main():
            sockets = [await authed(live) for _ in range(4)]        # upgraded: not counted
            for ws in sockets:
                await ws.close()
        asyncio.run(main())



def test_a_request_with_too_many_messages_is_refused_before_they_are_validated(live):
    """25k empty messages are under the body limit but cost their template and validation
    per message: a 400 naming `messages`, before any of that work."""
    from gateway.schemas import MAX_MESSAGES

    body = {"messages": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1), "max_tokens": 1}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert str(MAX_MESSAGES) in r.json()["error"]["message"]
    ok = {"messages": [{"role": "user", "content": "hi"}] * MAX_MESSAGES, "max_tokens": 1}
    assert httpx.post(f"{live.url}/v1/chat/completions", json=ok, headers=AUTH, timeout=30).status_code == 200
