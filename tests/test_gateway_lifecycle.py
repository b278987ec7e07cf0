"""How requests end: client disconnects, deadlines before and after the first token,
loading, and draining on SIGTERM — each frees blocks and leases and bills exactly once.

A stream that must outlast a wait (a disconnect, a deadline, a drain grace) runs on the
real engine held after a few steps (tests/held_engine.py), not on a model slow enough."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import websockets

from engine import AsyncEngine
from tests.held_engine import HeldEngine
from tests.live import KEYS, engine_config, serve, wait_until

HELLO = [{"role": "user", "content": "Write a long story about a lighthouse."}]
AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}


def idle(live) -> bool:
    s = live.engine_stats()
    return s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0 and \
        live.gateway.quotas.in_flight("acme") == 0


def held(tiny_model, steps: int = 16, **engine_kw) -> tuple[str, HeldEngine]:
    """The 2-layer model's real engine, held after `steps` steps: a stream lasts until an
    event ends it, however fast this host runs the model."""
    model = tiny_model("llama")
    return model, HeldEngine(engine_config(model, **engine_kw), steps=steps)


def sse_lines(live, body: dict, limit: int | None = None, on_line=None) -> list[str]:
    lines = []
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={"stream": True, **body}, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if on_line is not None:
                    on_line()
                if limit is not None and len(lines) >= limit:
                    break           # leaving the block closes the connection mid-stream
    return lines


def test_disconnect_mid_stream_aborts_frees_and_bills_what_was_produced(tiny_model, tmp_path):
    """Closing the HTTP stream aborts the engine request within a step; blocks, slot and lease return."""
    model, engine = held(tiny_model)
    with serve(model, tmp_path, engine=engine) as live:
        # two more steps per line read: the stream reaches 5 lines, never its 1500 tokens
        lines = sse_lines(live, {"messages": HELLO, "max_tokens": 1500}, limit=5, on_line=lambda: engine.allow(2))
        assert len(lines) == 5
        assert wait_until(lambda: idle(live)), live.engine_stats()
        billed = live.gateway.quotas.ledger.used_today("acme")
        tok = live.gateway.chat.admitter.tokenizers
        prompt = len(tok.encode(tok.render(HELLO)))
        assert prompt + 4 <= billed < prompt + 1500      # at least the 4 content chunks we read
        metrics = httpx.get(f"{live.url}/metrics").text
        assert 'streamgate_gateway_requests_total{status="499",tenant="acme",transport="sse"} 1.0' in metrics


def test_deadline_before_first_token_is_a_504_and_bills_nothing(tiny_model, tmp_path):
    """With the only slot busy, a request whose deadline passes in the queue gets 504 deadline_exceeded."""
    model, engine = held(tiny_model, max_num_seqs=1)
    with serve(model, tmp_path, engine=engine, engine_kw={"max_num_seqs": 1}) as live:
        async def scenario():
            async with websockets.connect(live.ws_url, additional_headers=AUTH) as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "chat.request", "id": 1, "messages": HELLO, "max_tokens": 1500}))
                assert json.loads(await ws.recv())["type"] == "chat.delta"
                r = await asyncio.to_thread(httpx.post, f"{live.url}/v1/chat/completions", headers=AUTH,
                                            json={"messages": HELLO, "stream": True, "deadline_ms": 300}, timeout=30)
                await ws.send(json.dumps({"type": "chat.cancel", "id": 1}))
                # Read to the end: with unread frames queued past its max_queue, the websockets
                # client's close waits out close_timeout (10 s; python-websockets issue 1555).
                while (msg := json.loads(await ws.recv()))["type"] == "chat.delta":
                    pass
                assert msg["type"] == "chat.done" and msg["finish_reason"] == "abort"
                return r
        r = asyncio.run(asyncio.wait_for(scenario(), 60))   # a bound, should it hang
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        assert wait_until(lambda: idle(live))
        assert live.engine_stats()["deadline_drops"] == 1


def test_deadline_after_first_token_is_an_in_stream_error(tiny_model, tmp_path):
    """A deadline that passes mid-answer ends the stream with a deadline_exceeded error event (no [DONE])."""
    model, engine = held(tiny_model)
    with serve(model, tmp_path, engine=engine) as live:
        lines = sse_lines(live, {"messages": HELLO, "max_tokens": 1900, "deadline_ms": 400})
        assert lines[-1] != "[DONE]"
        assert json.loads(lines[-1])["error"]["code"] == "deadline_exceeded"
        produced = sum(1 for line in lines[1:-1] if json.loads(line)["choices"][0]["delta"].get("content"))
        assert produced > 0
        assert wait_until(lambda: idle(live))
        engine.allow(16)        # the next stream's first tokens, then held again
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS["acme"], max_retries=0)
        with pytest.raises(openai.APIError, match="deadline"):
            for _ in client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1900, stream=True,
                                                    extra_headers={"X-Request-Timeout": "0.4"}):
                pass


class GatedEngine(AsyncEngine):
    """The real engine whose model load waits for a gate, to observe the loading state."""

    def __init__(self, config):
        super().__init__(config)
        self.gate = threading.Event()

    async def start(self):
        await asyncio.to_thread(self.gate.wait, 30)
        await super().start()


def test_health_is_503_while_the_model_loads(tiny_model, tmp_path):
    """Before the engine is up: /health 503 'loading' and chat 503; then 200 and chat works."""
    engine = GatedEngine(engine_config(tiny_model("llama")))
    with serve(tiny_model("llama"), tmp_path, engine=engine, ready=False) as live:
        r = httpx.get(f"{live.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(f"{live.url}/v1/chat/completions", headers=AUTH, json={"messages": HELLO})
        assert r.status_code == 503 and r.headers["retry-after"]
        engine.gate.set()
        assert wait_until(lambda: httpx.get(f"{live.url}/health").status_code == 200)
        r = httpx.post(f"{live.url}/v1/chat/completions", headers=AUTH, json={"messages": HELLO, "max_tokens": 3})
        assert r.status_code == 200


def test_sigterm_drains_then_aborts_with_a_final_event(tiny_model, tmp_path):
    """On SIGTERM: new work gets 503/1012, a short stream finishes, long ones end with server_draining."""
    model, engine = held(tiny_model)
    with serve(model, tmp_path, engine=engine, drain_grace_s=1.0) as live:
        async def scenario():
            async with websockets.connect(live.ws_url, additional_headers=AUTH) as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "chat.request", "id": "long", "messages": HELLO,
                                          "max_tokens": 1900}))
                assert json.loads(await ws.recv())["type"] == "chat.delta"
                streaming = threading.Event()
                sse = asyncio.ensure_future(asyncio.to_thread(sse_lines, live, {"messages": HELLO,
                                                                                "max_tokens": 1900},
                                                              on_line=streaming.set))
                # (on a busy host the SSE request can take a while to arrive: wait for it)
                assert await asyncio.to_thread(wait_until, lambda: len(live.gateway.chat.active) == 2, 30)
                engine.allow(16)        # the SSE stream's first tokens (its headers go with the first)
                assert await asyncio.to_thread(streaming.wait, 30)
                live.sigterm()
                await asyncio.sleep(0.2)
                refused = await asyncio.to_thread(httpx.post, f"{live.url}/v1/chat/completions", headers=AUTH,
                                                  json={"messages": HELLO, "max_tokens": 2})
                health = await asyncio.to_thread(httpx.get, f"{live.url}/health")
                await ws.send(json.dumps({"type": "chat.request", "id": "late", "messages": HELLO}))
                events = []
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    while True:
                        msg = json.loads(await ws.recv())
                        if msg["type"] != "chat.delta":
                            events.append(msg)
                return refused, health, events, closed.value.rcvd.code, await sse
        refused, health, events, code, sse = asyncio.run(asyncio.wait_for(scenario(), 60))   # a bound, should it hang
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining"
        assert health.status_code == 503
        by_id = {e["id"]: e for e in events}
        assert by_id["late"]["error"]["code"] == "server_draining"
        assert by_id["long"]["type"] == "error" and by_id["long"]["error"]["code"] == "server_draining"
        assert code == 1012
        assert json.loads(sse[-1])["error"]["code"] == "server_draining"
        live.thread.join(timeout=20)
        assert not live.thread.is_alive(), "the server did not exit after draining"
        assert live.gateway.quotas.in_flight("acme") == 0


def test_drain_keeps_a_socket_until_the_client_echoes_close_1012(tiny_model, tmp_path):
    """Draining closes an idle WebSocket with 1012 and keeps its TCP connection until the
    client's close echo arrives, however late (within the wait): uvicorn's shutdown used to
    cut it, and a browser whose echo met a closed connection reported 1006, not 1012."""
    from websockets.client import ClientProtocol
    from websockets.frames import Close
    from websockets.uri import parse_uri

    def read_until(sock, proto, done):
        while not done():
            data = sock.recv(65536)
            assert data, "the server closed the TCP connection before the closing handshake"
            proto.receive_data(data)

    with serve(tiny_model("llama"), tmp_path, drain_grace_s=5) as live:
        proto = ClientProtocol(parse_uri(live.ws_url))
        request = proto.connect()
        request.headers["Authorization"] = AUTH["Authorization"]
        proto.send_request(request)
        with socket.create_connection(live.url.removeprefix("http://").split(":"), timeout=30) as sock:
            sock.sendall(b"".join(proto.data_to_send()))
            events = []
            read_until(sock, proto, lambda: events.extend(proto.events_received()) or
                       any(getattr(e, "data", None) for e in events[1:]))          # the hello frame
            live.sigterm()
            read_until(sock, proto, lambda: proto.close_rcvd is not None)
            assert proto.close_rcvd.code == 1012
            time.sleep(0.5)                    # a slow client: the server must still be there
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1, socket.MSG_PEEK)  # b"" here: the server closed before the echo
            sock.setblocking(True)
            sock.sendall(b"".join(proto.data_to_send()))                     # the echo
            assert isinstance(proto.close_sent, Close)
            assert sock.recv(1) == b""                                       # then the server closes
        live.thread.join(timeout=20)
        assert not live.thread.is_alive(), "the server did not exit after draining"
