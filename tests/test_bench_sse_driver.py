"""bench.serving.drivers.SseDriver against a real socket: a request sent on a keep-alive
connection that the server drops unanswered (llama.cpp's server does) goes once more on a fresh
connection; a stream cut after its answer began is a failure, never sent twice."""

from __future__ import annotations

import asyncio
import json

from bench.serving.drivers import SseDriver
from bench.serving.loadgen import Req
from bench.serving.replay import new_record


class Server:
    """HTTP/1.1 on 127.0.0.1: every connection's first request gets a streamed answer of two
    tokens (or, with `cut`, its headers and one token, then the connection closes); a second
    request on the same connection is read and dropped unanswered."""

    def __init__(self, cut: bool = False):
        self.cut = cut
        self.requests = 0          # requests read, answered or not
        self.connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def read_request(self, reader) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        self.requests += 1
        return True

    async def handle(self, reader, writer) -> None:
        self.connections += 1
        await self.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        events = [{"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]},
                  {"choices": [{"delta": {"content": " there"}, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}]
        for i, event in enumerate(events):
            data = f"data: {json.dumps(event)}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            if self.cut and i == 0:
                writer.close()
                return
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        try:
            await self.read_request(reader)       # the next request on this connection: dropped
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def request(i: int) -> Req:
    return Req(f"r{i}", "t", "c", None, 0, 0.0, [{"role": "user", "content": "hello"}], max_tokens=2)


async def send_in_turn(server: Server, n: int) -> list[dict]:
    url = await server.start()
    driver = SseDriver(url, {"t": "key"})
    await driver.open([])
    recs = []
    try:
        for i in range(n):                       # one after another: each reuses the last connection
            rec = new_record(request(i))
            await driver.send(request(i), rec, 0.0)
            recs.append(rec)
    finally:
        await driver.close()
        server.server.close()
    return recs


def test_a_request_dropped_on_a_stale_connection_is_sent_again():
    server = Server()
    recs = asyncio.run(send_in_turn(server, 3))
    assert [r["error"] for r in recs] == [None, None, None]
    assert [r["output_tokens"] for r in recs] == [2, 2, 2] and all(len(r["deltas"]) == 2 for r in recs)
    assert server.requests == 5 and server.connections == 3      # requests 2 and 3 each went twice


def test_a_stream_cut_after_it_began_fails_and_is_not_sent_again():
    server = Server(cut=True)
    recs = asyncio.run(send_in_turn(server, 1))
    assert recs[0]["error"].startswith("transport_error") and len(recs[0]["deltas"]) == 1
    assert server.requests == 1
