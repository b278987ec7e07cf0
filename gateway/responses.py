"""`POST /v1/responses`, stateless: the body becomes a chat request (responses_input.py) and
goes through the same admission, quotas, deadlines and billing (sse.serve_openai); the
answer is a Response object with reasoning, message and function_call output items, or
a stream of the event types of openai-python's `openai.types.responses` (`event:` lines),
ending with `response.completed` (or `response.incomplete`, or an `error` event)."""

from __future__ import annotations

import json
import uuid

from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response

from .chat_api import choice_parser
from .chat_format import ChoiceFormat, event_json
from .errors import BadRequest
from .responses_input import Refused, ResponsesRequest, chat_body
from .schemas import parse_body
from .sse import serve_openai
from .streaming import Delta, Done
from .tool_parsers import ToolCallDelta


class LastEvent(ServerSentEvent):
    last = True         # sse.ClosingEventStream stops its keep-alives after it


def _convert(holder: dict):
    def convert(body: object) -> dict:
        req = parse_body(ResponsesRequest, body)
        holder["request"] = req
        try:
            return chat_body(req)
        except Refused as exc:
            raise BadRequest(str(exc), param=exc.field) from None
    return convert


def _usage(done: Done) -> dict:
    u = done.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def _response(adm, req: ResponsesRequest, rid: str, status: str, output: list, usage: dict | None) -> dict:
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    return {"id": rid, "object": "response", "created_at": adm.created, "status": status, "model": adm.model,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "output": output, "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": adm.params.temperature, "top_p": adm.params.top_p, "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "truncation": "disabled", "usage": usage, "user": req.user}


def _status(reason: str) -> str:
    return "incomplete" if reason == "length" else "completed"


def _items(fmt: ChoiceFormat) -> list[dict]:
    msg, out = fmt.message(), []
    if msg.get("reasoning_content"):
        out.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "status": "completed",
                    "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg["content"] or not msg.get("tool_calls"):
        out.append(_message_item(f"msg_{uuid.uuid4().hex}", msg["content"] or "", "completed"))
    for call in msg.get("tool_calls", ()):
        out.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                    "status": "completed"})
    return out


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def whole(holder: dict):
    def body(gw, adm, deltas: list[Delta], done: Done) -> dict:
        fmt = ChoiceFormat(adm, choice_parser(gw, adm.request))
        for d in deltas:
            fmt.feed(d.text)
        fmt.finish()
        return _response(adm, holder["request"], "resp_" + adm.request_id.split("-", 1)[-1],
                         _status(done.finish_reason), _items(fmt), _usage(done))
    return body


class _Events:
    """Open output items and the events that open, fill and close them."""

    def __init__(self):
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None
        self.text = ""

    def event(self, kind: str, **fields) -> ServerSentEvent:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ServerSentEvent(event_json(data), event=kind)

    def start(self, item: dict) -> list:
        out = self.close()
        self.open, self.text = item, ""
        index = len(self.items)
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def add(self, piece) -> list:
        index = len(self.items)
        if isinstance(piece, ToolCallDelta):
            out = []
            if piece.id is not None:
                out = self.start({"type": "function_call", "id": f"fc_{piece.id}", "call_id": piece.id,
                                  "name": piece.name, "arguments": "", "status": "in_progress"})
            if piece.arguments:
                self.text += piece.arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=index, delta=piece.arguments))
            return out
        kind, text = piece
        want = "reasoning" if kind == "reasoning" else "message"
        out = []
        if self.open is None or self.open["type"] != want:
            item_id = f"{'rs' if want == 'reasoning' else 'msg'}_{uuid.uuid4().hex}"
            out = self.start({"type": "reasoning", "id": item_id, "summary": [], "content": [],
                              "status": "in_progress"} if want == "reasoning" else
                             _message_item(item_id, "", "in_progress"))
        self.text += text
        name = "response.reasoning_text.delta" if want == "reasoning" else "response.output_text.delta"
        extra = {} if want == "reasoning" else {"logprobs": []}
        out.append(self.event(name, item_id=self.open["id"], output_index=len(self.items), content_index=0,
                              delta=text, **extra))
        return out

    def close(self) -> list:
        item, out = self.open, []
        if item is None:
            return out
        index, iid = len(self.items), item["id"]
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            out.append(self.event("response.output_text.done", item_id=iid, output_index=index, content_index=0,
                                  text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=iid, output_index=index, content_index=0,
                                  part=part))
            item = {**item, "content": [part]}
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=iid, output_index=index, content_index=0,
                                  text=self.text))
            item = {**item, "content": [{"type": "reasoning_text", "text": self.text}]}
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=iid, output_index=index,
                                  name=item["name"], arguments=self.text))
            item = {**item, "arguments": self.text}
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        self.open = None
        return out


def chunks(holder: dict):
    async def stream(gw, adm, first, events):
        req, ev = holder["request"], _Events()
        rid = "resp_" + adm.request_id.split("-", 1)[-1]
        fmt = ChoiceFormat(adm, choice_parser(gw, adm.request))
        try:
            yield ev.event("response.created", response=_response(adm, req, rid, "in_progress", [], None))
            yield ev.event("response.in_progress", response=_response(adm, req, rid, "in_progress", [], None))
            event = first
            while True:
                if isinstance(event, Delta):
                    for piece in fmt.feed(event.text):
                        for e in ev.add(piece):
                            yield e
                elif isinstance(event, Done):
                    for piece in fmt.finish():
                        for e in ev.add(piece):
                            yield e
                    if not ev.items and ev.open is None:
                        for e in ev.add(("content", "")):
                            yield e
                    for e in ev.close():
                        yield e
                    status = _status(event.finish_reason)
                    final = ev.event(f"response.{status}",
                                     response=_response(adm, req, rid, status, ev.items, _usage(event)))
                    yield LastEvent(final.data, event=final.event)
                    return
                else:
                    err = event.error.body()["error"]
                    yield LastEvent(json.dumps({"type": "error", "sequence_number": ev.seq, "code": err["code"],
                                                "message": err["message"], "param": err["param"], "error": err}),
                                    event="error")
                    return
                event = await anext(events)
        finally:
            await events.aclose()
    return stream


async def responses(request: Request) -> Response:
    holder: dict = {}
    return await serve_openai(request, "chat", chunks(holder), whole(holder), convert=_convert(holder))
