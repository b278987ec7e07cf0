"""OpenAI-compatible HTTP: `POST /v1/chat/completions` (SSE stream or one JSON body) and
`GET /v1/models`. This module only adapts `chat.ChatService` events to OpenAI's format.

A streamed answer's headers are held back until the first token (or the failure) is
known, so a deadline that passes in the queue is a real 504 and a refused request a real
429/503; while waiting, a client that hangs up is noticed and its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re


from sse_starlette import EventSourceResponse
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from .auth import bearer_key
from .chat_api import Last, chat_body, chat_chunks
from .errors import BadRequest, BodyTimeout, GatewayError, PayloadTooLarge
from .schemas import timeout_from_header
from .streaming import CLIENT_CLOSED, Delta, Failed


def error_response(exc: GatewayError, extra_headers: dict | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers={**(extra_headers or {}), **exc.headers})


def parse_json(data: bytes | str, max_values: int, *, check_unicode: bool = True) -> object:
    """Decode a JSON body or frame; any failure (including nesting too deep for the
    decoder) is a 400 `invalid_json`. Decoding holds the GIL for its whole run (a thread
    would stall the event loop just the same) and costs ~0.1 µs per value: 1 MiB of
    `[0,0,...]` takes ~60 ms of CPU, 1 MiB of prose ~1 ms. So a document with more than
    `max_values` commas and opening brackets (counted anywhere, strings included: an
    upper bound on its values, ~2 ms per MiB to count) is refused before decoding. A
    string holding a lone surrogate is a 400 `invalid_unicode` naming it (`check_unicode`;
    a WebSocket checks its request bodies itself, to answer with the request's id)."""
    sep, opens = (b",", (b"[", b"{")) if isinstance(data, bytes) else (",", ("[", "{"))
    values = data.count(sep) + data.count(opens[0]) + data.count(opens[1])
    if values > max_values:
        raise BadRequest(f"the JSON document has {values} commas and brackets; the limit is {max_values}",
                         code="too_many_json_values")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadRequest("the request body is not valid JSON", code="invalid_json") from None
    if check_unicode and _SURROGATE_ESCAPE.search(data if isinstance(data, str) else data.decode("latin-1")):
        refuse_lone_surrogates(doc)         # only then walk it (bounded by max_values)
    return doc


def refuse_lone_surrogates(doc) -> None:
    """A 400 naming the first string that holds a lone surrogate (no tokenizer, log line or
    frame can carry one)."""
    path = lone_surrogate_at(doc)
    if path is not None:
        raise BadRequest(f"{path or 'body'}: a lone UTF-16 surrogate (\\ud800-\\udfff escape) is not text; "
                         "send valid Unicode", param=path or None, code="invalid_unicode")


# A \uD800-\uDFFF escape: where JSON can smuggle a lone surrogate (raw UTF-8 cannot carry one).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def lone_surrogate_at(doc) -> str | None:
    """The dotted path (`messages.0.content`) of the first string holding a lone
    surrogate ('' for the document itself), or None."""
    stack: list[tuple[object, str]] = [(doc, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode()
                except UnicodeEncodeError:
                    return path
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path))
                stack.append((v, f"{path}.{k}" if path else str(k)))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))
    return None


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, read chunk by chunk and cut off past `limit` bytes (413) or when it has
    not all arrived within `timeout_s` (408: a client trickling its body would otherwise
    hold its connection and its handler forever). A client that hangs up while sending
    raises ClientDisconnect."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []

    async def collect() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the request body is larger than the limit of {limit} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTimeout(f"the request body did not all arrive within {timeout_s:g} s",
                          headers={"connection": "close"}) from None
    return b"".join(chunks)


class _Disconnect:
    """Watches an HTTP request's receive channel for the client hanging up."""

    def __init__(self, request: Request):
        self.task = asyncio.ensure_future(self._wait(request.receive))

    @staticmethod
    async def _wait(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def next_event(self, events):
        """The next pipeline event, or None (and the pipeline closed) if the client left first."""
        step = asyncio.ensure_future(anext(events))
        try:
            await asyncio.wait({step, self.task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:      # the server cancelled this handler: close the pipeline
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
            await events.aclose()
            raise
        if step.done():
            return step.result()
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await step
        await events.aclose()
        return None

    def close(self) -> None:
        self.task.cancel()


async def chat_completions(request: Request) -> Response:
    return await serve_openai(request, "chat", chat_chunks, chat_body)


async def serve_openai(request: Request, kind: str, chunks, whole, convert=None) -> Response:
    """One OpenAI-style generation endpoint: `kind` of request (admission.REQUEST_KINDS),
    `chunks(gw, adm, first, events)` the SSE payloads, `whole(gw, adm, deltas, done)` the
    JSON answer, `convert(body)` the body as admission takes it (Responses -> chat)."""
    gw = request.app.state.gateway
    tenant = gw.authenticate(bearer_key(request.headers.get("authorization")))
    gw.chat.precheck(tenant, "http")        # over its limits: refused before its body costs anything
    try:
        body = parse_json(await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout_s),
                          gw.settings.max_json_values)
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)      # nobody is left to read it
    stream = isinstance(body, dict) and body.get("stream") is True     # the parser refuses non-booleans
    timeout_s = timeout_from_header(request.headers.get("x-request-timeout"))
    if convert is not None:
        body = convert(body)
    adm = await gw.chat.admit(tenant, body, transport="sse" if stream else "http", timeout_s=timeout_s, kind=kind)
    headers = gw.quotas.headers(tenant)
    events = gw.chat.run(adm)
    watch = _Disconnect(request)
    handed_off = False
    try:
        first = await watch.next_event(events)
        if first is None:
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(first, Failed):
            return error_response(first.error, headers)
        if stream:
            watch.close()       # from here on sse-starlette watches for the hang-up
            handed_off = True
            return ClosingEventStream(events.aclose, chunks(gw, adm, first, events), headers=headers, sep="\n",
                                      ping=gw.settings.keepalive_s)
        deltas, event = [], first
        while isinstance(event, Delta):
            deltas.append(event)
            event = await watch.next_event(events)
        if event is None:
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(event, Failed):
            return error_response(event.error, headers)
        return JSONResponse(whole(gw, adm, deltas, event), headers=headers)
    finally:
        watch.close()
        if not handed_off:
            await events.aclose()       # settle now, not when the generator is collected


class ClosingEventStream(EventSourceResponse):
    """An SSE response that runs `on_close` (async) however it ends, even if it was
    cancelled before its body was first iterated (then the body generator's own `finally`
    never runs) or never iterated at all (HEAD): chat streams close their pipeline, stats
    streams give back their subscription and place (gateway/holds.py). A client that stops
    reading is cut off by the write deadline (gateway/deadline.py); the stream then ends
    here like any hang-up."""

    def __init__(self, on_close, content, **kw):
        super().__init__(self._quiet_after_last(content), **kw)
        self.on_close = on_close

    async def _quiet_after_last(self, content):
        """No keep-alive comment after the stream's `Last` payload: the body's cleanup (settling
        the request) runs after it, and a ping sent meanwhile would follow `[DONE]`."""
        async for item in content:
            yield item
            if isinstance(item, Last) or getattr(item, "last", False):
                self.active = False             # sse-starlette's ping loop checks it before each ping

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


async def list_models(request: Request) -> Response:
    gw = request.app.state.gateway
    gw.authenticate(bearer_key(request.headers.get("authorization")))
    return JSONResponse({"object": "list", "data": [
        {"id": gw.chat.model_name, "object": "model", "created": gw.started_at, "owned_by": "streamgate",
         "max_model_len": gw.chat.max_model_len}]})     # as vLLM reports it: the longest prompt + output
