"""`/v1/completions` and `/v1/responses` over the WebSocket (docs/PROTOCOL.md 4.3.1): a
`completion.request` or `response.request` frame is admitted like a `chat.request` (same
admission, quotas, deadlines and billing; `chat.cancel` stops it) and streamed by the SSE
endpoints' own formatters (completions.completion_chunks, responses.chunks), each SSE
payload sent as one frame:

    completion.chunk {id, chunk}            a text_completion chunk, as SSE sends it
    completion.done  {id, usage, timings}   terminal
    response.event   {id, event}            a Responses streaming event, as SSE sends it
    response.done    {id, event}            terminal: response.completed / incomplete / failed
    error            {id, error}            terminal, as for chat

Reusing the formatters keeps one definition of each body; the price is a JSON round trip
per frame (the formatters write SSE text).
"""

from __future__ import annotations

import json

from .chat_api import Last
from .completions import completion_chunks
from .responses import _convert, chunks as response_chunks
from .streaming import Failed
from .ws_socket import _Gone

KINDS = ("completion", "response")


def admission_body(kind: str, body: dict) -> tuple[str, dict, object]:
    """(the admission kind, the body as admission takes it, the formatter) of a request frame;
    raises BadRequest (a Responses body that cannot be converted)."""
    if kind == "completion":
        return "completion", {**body, "stream_options": {"include_usage": True}}, completion_chunks
    holder: dict = {}
    return "chat", _convert(holder)(body), response_chunks(holder)


async def stream(conn, cid, adm, kind: str, formatter) -> None:
    """Run one admitted request on `conn` (ws.Connection): its frames, exactly one terminal."""
    events = conn.gw.chat.run(adm)
    ended = False
    try:
        first = await anext(events)
        if isinstance(first, Failed):
            ended = True
            return await conn.send_error(cid, first.error)
        usage: dict = {}
        async for payload in formatter(conn.gw, adm, first, events):
            frame, last = _completion_frame(payload, usage) if kind == "completion" else _response_frame(payload)
            ended = ended or last
            if frame is not None:
                await conn.send({**frame, "id": cid})
    except _Gone:
        pass            # the socket went away; closing the pipeline aborts and settles
    except Exception as exc:
        await conn.stream_fault(cid, adm, exc, ended)
    finally:
        await events.aclose()
        conn.streams.pop(str(cid), None)


def _completion_frame(payload, usage: dict) -> tuple[dict | None, bool]:
    if isinstance(payload, Last):
        if payload == "[DONE]":
            return {"type": "completion.done", **usage}, True
        return {"type": "error", "error": json.loads(payload)["error"]}, True
    chunk = json.loads(payload)
    if not chunk["choices"] and chunk.get("usage") is not None:        # the usage chunk: on the done frame
        usage.update(usage=chunk["usage"], timings=chunk.get("timings"))
        return None, False
    chunk.pop("usage", None)                                            # null on every other chunk
    return {"type": "completion.chunk", "chunk": chunk}, False


def _response_frame(payload) -> tuple[dict, bool]:
    event = json.loads(payload.data)
    if not getattr(payload, "last", False):
        return {"type": "response.event", "event": event}, False
    if event["type"] == "error":
        return {"type": "error", "error": event["error"]}, True
    return {"type": "response.done", "event": event}, True
