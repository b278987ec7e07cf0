"""The WebSocket protocol against a real uvicorn with a `websockets` client: interleaved
requests, cancel, bad frames, auth and Origin checks, close codes, the stats stream."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.held_engine import HeldEngine
from tests.idle import idle_after  # noqa: F401 - fixture
from tests.live import KEYS, engine_config, serve, tenants, wait_until

HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


pytestmark = pytest.mark.usefixtures("idle_after")     # every test leaves the server idle

@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    """The tiny model's real engine, stepping freely unless a test holds it (tests/held_engine.py):
    a stream that is cancelled must still be running when the cancel arrives, whatever this
    host's speed."""
    model = tiny_model("llama")
    engine = HeldEngine(engine_config(model), steps=None)
    with serve(model, tmp_path_factory.mktemp("ws"), engine=engine, registry=tenants(),
               max_frame_bytes=64 * 1024) as server:
        yield server


async def connect(live, key: str | None = KEYS["acme"], **kw):
    ws = await websockets.connect(live.ws_url, **kw)
    if key is not None:
        await ws.send(json.dumps({"type": "auth", "api_key": key}))
        assert json.loads(await ws.recv()) == {"type": "auth.ok", "tenant": "acme"}
    return ws


async def recv(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout=30))


async def test_two_interleaved_requests_on_one_socket(live):
    """Deltas of two requests arrive interleaved by id; each ends with exactly one chat.done."""
    engine = live.gateway.engine
    engine.hold(4)      # then two steps per delta read: the engine never runs far ahead of the reader
    try:
        async with await connect(live) as ws:
            for rid in ("a", "b"):
                await ws.send(json.dumps({"type": "chat.request", "id": rid, "messages": HELLO, "max_tokens": 20,
                                          "temperature": 0}))
            order, done = [], {}
            while len(done) < 2:
                msg = await recv(ws)
                assert msg["type"] in ("chat.delta", "chat.done"), msg
                if msg["type"] == "chat.delta":
                    assert msg["id"] not in done
                    order.append(msg["id"])
                    engine.allow(2)
                else:
                    assert msg["id"] not in done
                    done[msg["id"]] = msg
    finally:
        engine.release()
    switches = sum(1 for x, y in zip(order, order[1:]) if x != y)
    assert switches >= 2, order
    for msg in done.values():
        assert msg["finish_reason"] == "length" and msg["usage"]["completion_tokens"] == 20
        assert msg["timings"]["ttft_ms"] is not None


async def test_cancel_ends_the_request_and_frees_blocks_and_lease(live):
    """chat.cancel gets chat.done(abort); the engine frees the request's blocks and the lease returns."""
    engine = live.gateway.engine
    engine.hold(16)                 # the stream is still running when the cancel arrives
    try:
        async with await connect(live) as ws:
            await ws.send(json.dumps({"type": "chat.request", "id": 7, "messages": HELLO, "max_tokens": 1000}))
            assert (await recv(ws))["type"] == "chat.delta"
            await ws.send(json.dumps({"type": "chat.cancel", "id": 7}))
            msg = await recv(ws)
            while msg["type"] == "chat.delta":
                msg = await recv(ws)
            assert msg["type"] == "chat.done" and msg["id"] == 7 and msg["finish_reason"] == "abort"
            assert 0 < msg["usage"]["completion_tokens"] < 1000
    finally:
        engine.release()
    assert wait_until(lambda: live.engine_stats()["running"] == 0 and live.engine_stats()["kv_blocks_used"] == 0)
    assert live.gateway.quotas.in_flight("acme") == 0


async def test_bad_json_and_unknown_types_leave_the_socket_usable(live):
    """A bad frame gets an error event; the socket keeps working (ping → pong)."""
    async with await connect(live) as ws:
        await ws.send("{not json")
        err = await recv(ws)
        assert err["type"] == "error" and err["error"]["code"] == "invalid_json"
        await ws.send(json.dumps({"type": "chat.nonsense", "id": "x"}))
        err = await recv(ws)
        assert err["type"] == "error" and err["id"] == "x" and err["error"]["param"] == "type"
        await ws.send(json.dumps({"type": "chat.request", "id": "t", "messages": HELLO, "temperature": -1}))
        err = await recv(ws)
        assert err["id"] == "t" and err["error"]["param"] == "temperature"
        await ws.send(json.dumps({"type": "chat.request", "id": "u", "messages": HELLO, "timeout_s": "soon"}))
        err = await recv(ws)
        assert err["id"] == "u" and err["error"]["param"] == "timeout_s"
        await ws.send(json.dumps({"type": "ping"}))
        assert await recv(ws) == {"type": "pong"}


async def test_oversize_frame_closes_with_1009(live):
    """A frame over max_frame_bytes closes the socket with 1009."""
    async with await connect(live, max_size=None) as ws:
        await ws.send(json.dumps({"type": "ping", "pad": "x" * (128 * 1024)}))
        with pytest.raises(websockets.ConnectionClosed) as exc:
            await recv(ws)
    assert exc.value.rcvd.code == 1009


async def test_auth_missing_wrong_or_by_header(live):
    """No auth before a request → 1008; a wrong key → 1008; a header key works without a message."""
    async with await connect(live, key=None) as ws:
        await ws.send(json.dumps({"type": "chat.request", "id": 1, "messages": HELLO}))
        with pytest.raises(websockets.ConnectionClosed) as exc:
            await recv(ws)
    assert exc.value.rcvd.code == 1008 and "auth" in exc.value.rcvd.reason
    async with await connect(live, key=None) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": "sk-wrong"}))
        with pytest.raises(websockets.ConnectionClosed) as exc:
            await recv(ws)
    assert exc.value.rcvd.code == 1008 and exc.value.rcvd.reason == "invalid API key"
    async with await connect(live, key=None, additional_headers={"Authorization": f"Bearer {KEYS['acme']}"}) as ws:
        assert (await recv(ws))["type"] == "auth.ok"
        await ws.send(json.dumps({"type": "chat.request", "id": 1, "messages": HELLO, "max_tokens": 2}))
        msgs = [await recv(ws) for _ in range(2)]
        while msgs[-1]["type"] != "chat.done":
            msgs.append(await recv(ws))


async def test_cross_site_origin_is_refused(live):
    """A browser Origin from another site cannot open the socket; the same host can."""
    with pytest.raises(websockets.InvalidStatus) as exc:
        await websockets.connect(live.ws_url, origin="http://evil.example")
    assert exc.value.response.status_code == 403
    host = live.url.removeprefix("http://")
    async with await websockets.connect(live.ws_url, origin=f"http://{host}") as ws:
        await ws.send(json.dumps({"type": "ping"}))
        assert await recv(ws) == {"type": "pong"}


async def test_stats_stream_is_aggregate_only(live):
    """stats.subscribe pushes queue, KV and token-split numbers, and no request text."""
    engine = live.gateway.engine
    # The stream is held after 16 steps until a 100 ms stats tick has shown it running (the
    # 2-layer model wrote 400 tokens within one tick on a fast host), then runs to its end.
    engine.hold(16)
    try:
        async with await connect(live) as ws:
            await ws.send(json.dumps({"type": "stats.subscribe", "interval_ms": 100}))
            await ws.send(json.dumps({"type": "chat.request", "id": "s", "messages": HELLO, "max_tokens": 400}))
            seen_running, text = False, ""
            for _ in range(4000):
                msg = await recv(ws)
                if msg["type"] == "stats":
                    eng = msg["engine"]
                    assert {"waiting", "running", "swapped", "kv_blocks_used", "kv_blocks_total",
                            "num_decode_tokens", "num_prefill_tokens", "num_preemptions"} <= set(eng)
                    seen_running |= eng["running"] > 0
                    assert "Hello there" not in json.dumps(msg)
                elif msg["type"] == "chat.delta":
                    text += msg["text"]
                elif msg["type"] == "chat.done":
                    break
                if seen_running and text:
                    engine.release()
            assert seen_running and text
    finally:
        engine.release()


async def test_a_gateway_fault_mid_stream_ends_that_request_with_one_error(live, monkeypatch):
    """A bug in the gateway's own frame formatting after the first delta (injected): that
    request ends with exactly one error frame, no chat.done and nothing after it; the engine aborts it, its blocks
    and lease come back, and the socket serves the next request."""
    from gateway.ws_format import WsFrames

    real, calls = WsFrames.delta, {"n": 0}

    def failing_delta(self, event):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected formatting bug")
        return real(self, event)

    engine = live.gateway.engine
    engine.hold(8)                  # the stream is still running when the fault happens
    try:
        async with await connect(live) as ws:
            monkeypatch.setattr(WsFrames, "delta", failing_delta)
            await ws.send(json.dumps({"type": "chat.request", "id": "f", "messages": HELLO, "max_tokens": 1000}))
            msgs = [await recv(ws)]
            while msgs[-1]["type"] == "chat.delta":
                msgs.append(await recv(ws))
            assert [m["type"] for m in msgs] == ["chat.delta", "error"], msgs
            assert msgs[-1]["id"] == "f" and "inside the gateway" in msgs[-1]["error"]["message"]
            # aborted while the engine still holds it (a held engine serves aborts), not run out
            assert wait_until(lambda: live.engine_stats()["running"] == 0 and live.engine_stats()["kv_blocks_used"] == 0)
            monkeypatch.setattr(WsFrames, "delta", real)
            engine.release()
            await ws.send(json.dumps({"type": "chat.request", "id": "g", "messages": HELLO, "max_tokens": 3}))
            after = [await recv(ws)]
            while after[-1]["type"] == "chat.delta":
                after.append(await recv(ws))
            assert after[-1]["type"] == "chat.done" and {m["id"] for m in after} == {"g"}, after
    finally:
        engine.release()
    assert wait_until(lambda: live.engine_stats()["running"] == 0 and live.engine_stats()["kv_blocks_used"] == 0)
    assert live.gateway.quotas.in_flight("acme") == 0
