"""A stateless `POST /v1/responses` body (schemas below) turned into the chat body that
admission takes: `instructions` as a system message, input items as messages (function
calls as an assistant turn's `tool_calls`, their outputs as `tool` turns), function tools,
`tool_choice` and `text.format` as chat's `tools`, `tool_choice` and `response_format`.

What needs server-side state (`previous_response_id`, `item_reference`, `conversation`) or
another modality (images, files, built-in tools) is refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field



class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: object = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = Field(default=False, strict=True)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    conversation: object = None
    store: bool | None = None
    metadata: dict | None = None
    user: str | None = None
    # streamgate extensions, as in chat
    priority: int | None = None
    deadline_ms: int | None = None
    separate_reasoning: bool = True
    ignore_eos: bool = False


class Refused(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _text_of(content, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Refused(field, "content must be a string or a list of input_text parts")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise Refused(f"{field}.{i}.type", f"only text content is supported (got {str(kind)[:40]!r})")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _messages(req: ResponsesRequest) -> list[dict]:
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        field = f"input.{i}"
        if not isinstance(item, dict):
            raise Refused(field, "an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise Refused(f"{field}.role", f"must be user, system, developer or assistant (got {str(role)[:20]!r})")
            messages.append({"role": role, "content": _text_of(item.get("content", ""), f"{field}.content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": output if isinstance(output, str) else _text_of(output, f"{field}.output")})
        elif kind == "reasoning":
            continue                    # earlier reasoning is not sent back to the model
        else:
            raise Refused(f"{field}.type", f"input items of type {str(kind)[:40]!r} are not supported "
                                           "(message, function_call, function_call_output, reasoning)")
    return messages


def _tools(req: ResponsesRequest) -> list[dict] | None:
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function":
            raise Refused(f"tools.{i}.type", f"only function tools are supported (got {str(tool.get('type'))[:40]!r})")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise Refused("tool_choice", "must be auto, none, required or {\"type\": \"function\", \"name\": ...}")


def _format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_ or {},
                                                   "strict": fmt.strict}}


def chat_body(req: ResponsesRequest) -> dict:
    """The chat body admission validates (its errors name chat's fields where they differ)."""
    if req.previous_response_id is not None:
        raise Refused("previous_response_id", "this server keeps no responses (stateless); send the whole "
                                              "conversation in input")
    if req.conversation is not None:
        raise Refused("conversation", "this server keeps no conversations (stateless)")
    body: dict = {"messages": _messages(req), "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls,
                  "separate_reasoning": req.separate_reasoning, "ignore_eos": req.ignore_eos}
    optional = {"model": req.model, "tools": _tools(req), "tool_choice": _tool_choice(req.tool_choice),
                "response_format": _format(req), "max_completion_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "priority": req.priority,
                "deadline_ms": req.deadline_ms}
    body.update({k: v for k, v in optional.items() if v is not None})
    return body
