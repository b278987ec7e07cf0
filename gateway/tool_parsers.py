"""Tool calls out of generated text, incrementally: `ToolCallParser.feed(text)` returns the
content to show and OpenAI `tool_calls` deltas (id and name first, then the arguments in
fragments that concatenate to the call's JSON arguments), `finish()` flushes.

Formats (`PARSERS`): `hermes` (Hermes, Qwen 2.5/3: `<tool_call>{"name", "arguments"}</tool_call>`),
`llama3_json` (Llama 3.x: `{"name", "parameters"}` as the whole answer, optionally after
`<|python_tag|>`, several separated by `;`), `mistral` (`[TOOL_CALLS][{"name", "arguments"}, ...]`
and the newer `[TOOL_CALLS]name[ARGS]{...}`). Two more serve a grammar-forced `tool_choice`:
`required` (the whole answer is a JSON array of `{"name", "arguments"}` objects) and `named`
(the whole answer is the named function's arguments object).

A call ends where its JSON object closes, found by scanning strings, escapes and brackets,
never by searching for an end marker: a `</tool_call>` inside an argument string is text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral")
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MISTRAL_NAME = re.compile(r"([A-Za-z0-9_.:-]{1,64})\[ARGS\]")
_START = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",)}
_SEPARATORS = ("</tool_call>", "<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|eom_id|>", "[/TOOL_CALLS]")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One entry of a chunk's `delta.tool_calls`: `id` and `name` on a call's first delta."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_dict(self) -> dict:
        d: dict = {"index": self.index}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        d["function"] = fn
        return d


class JsonEnd:
    """Finds where one JSON value ends in text fed piece by piece (strings and escapes
    respected). `feed(s)` returns the index in `s` just past the value's end, or None."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escape = self.started = self.scalar = False
        self.done = False

    def feed(self, s: str) -> int | None:
        for i, ch in enumerate(s):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self._end(i + 1)
                continue
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
                if ch not in "{[\"":
                    self.scalar = True
            if self.scalar:
                if ch in ",}]" or ch.isspace():
                    return self._end(i)
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self._end(i + 1)
        return None

    def _end(self, i: int) -> int:
        self.done = True
        return i


class _Call:
    """One call being read: a `{"name": ..., "arguments": ...}` object, or (a named call,
    `name` given) the arguments alone. The arguments stream as soon as the head is read;
    an object whose keys come in another order is parsed whole when it closes."""

    def __init__(self, index: int, name: str | None = None):
        self.index = index
        self.id = new_call_id()
        self.name = name
        self.wrapped = name is None     # the arguments sit inside a call object
        self.buf = ""
        self.obj = JsonEnd()
        self.args: JsonEnd | None = None if self.wrapped else JsonEnd()
        self.args_start = 0
        self.args_end: int | None = None
        self.sent = 0                   # characters of the arguments sent
        self.announced = False

    def feed(self, text: str, out: list) -> str | None:
        """Consume `text`; return what follows this call once it is complete, else None."""
        start = len(self.buf)
        self.buf += text
        end = None
        if self.wrapped:
            e = self.obj.feed(text)
            end = None if e is None else start + e
        if self.args is None:
            m = _HEAD.match(self.buf)
            if m is None or (end is not None and m.end() > end):
                return None if end is None else self._whole(end, out)
            self.name = json.loads(f'"{m.group(1)}"')
            self.args_start = m.end()
            self.args = JsonEnd()
            start = self.args_start
        if self.args_end is None:
            tail = self.args.feed(self.buf[start:])
            if tail is not None:
                self.args_end = start + tail
        self._announce(out)
        self._send_args(out)
        if not self.wrapped:
            end = self.args_end
        return None if end is None else self.buf[end:]

    def _whole(self, end: int, out: list) -> str:
        text = self.buf[:end]
        try:
            obj = json.loads(text)
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise NotACall(text, self.buf[end:]) from None
        self.name = name
        out.append(ToolCallDelta(self.index, self.id, name,
                                 args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        self.announced = True
        return self.buf[end:]

    def _announce(self, out: list) -> None:
        if not self.announced:
            out.append(ToolCallDelta(self.index, self.id, self.name, ""))
            self.announced = True

    def _send_args(self, out: list) -> None:
        stop = self.args_end if self.args_end is not None else len(self.buf)
        piece = self.buf[self.args_start + self.sent:stop]
        if piece:
            if out and isinstance(out[-1], ToolCallDelta) and out[-1].index == self.index:
                out[-1].arguments += piece
            else:
                out.append(ToolCallDelta(self.index, arguments=piece))
            self.sent += len(piece)


class NotACall(ValueError):
    """A JSON object in the calls' place that is not a call: it is text after all."""

    def __init__(self, text: str, rest: str):
        super().__init__("not a tool call")
        self.text, self.rest = text, rest


class ToolCallParser:
    """`kind`: one of PARSERS, "required" or "named" (then `name` is the function)."""

    def __init__(self, kind: str, name: str | None = None):
        if kind not in PARSERS + ("required", "named"):
            raise ValueError(f"unknown tool parser {kind!r} (one of {', '.join(PARSERS)})")
        self.kind = kind
        self.markers = _START.get(kind, ())
        self.in_calls = kind in ("required", "named")
        self.pending = ""           # held back: a possible marker prefix, or separators
        self.call: _Call | None = _Call(0, name) if kind == "named" else None
        self.count = 0 if self.call is None else 1
        self.seen_text = False      # content other than whitespace was emitted (llama3: calls only lead)

    def feed(self, text: str) -> list:
        """A list of content strings and ToolCallDeltas."""
        out: list = []
        self._feed(text, out)
        return out

    def _feed(self, text: str, out: list) -> None:
        while text:
            if self.call is not None:
                try:
                    rest = self.call.feed(text, out)
                except NotACall as exc:
                    self.call = None
                    self.count -= 1
                    self._say(exc.text, out)
                    self.in_calls, text = False, exc.rest
                    continue
                if rest is None:
                    return
                self.call, text = None, rest
                continue
            text, self.pending = self.pending + text, ""
            text = self._separators(text, out) if self.in_calls else self._content(text, out)

    def _content(self, text: str, out: list) -> str:
        if self.kind == "llama3_json" and not self.seen_text:
            stripped = text.lstrip()
            if stripped.startswith("{"):
                self.in_calls = True
                return stripped
            if not stripped:
                self.pending = text
                return ""
        hits = [(text.find(m), m) for m in self.markers if m in text]
        if hits:
            at, marker = min(hits)
            self._say(text[:at], out)
            self.in_calls = True
            return text[at + len(marker):]
        keep = max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        self._say(text[:len(text) - keep], out)
        self.pending = text[len(text) - keep:]
        return ""

    def _say(self, text: str, out: list) -> None:
        if text:
            self.seen_text = self.seen_text or not text.isspace()
            out.append(text)

    def _separators(self, text: str, out: list) -> str:
        while True:
            text = text.lstrip(" \t\r\n,;[]")
            if not text:
                return ""
            if text[0] == "{":
                self.call = _Call(self.count)
                self.count += 1
                return text
            m = _MISTRAL_NAME.match(text)
            if m and self.kind == "mistral":
                self.call = _Call(self.count, m.group(1))
                self.count += 1
                return text[m.end():]
            sep = next((s for s in _SEPARATORS if text.startswith(s)), None)
            if sep is not None:
                text = text[len(sep):]
                continue
            if any(s.startswith(text) for s in _SEPARATORS) or (
                    self.kind == "mistral" and re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}(\[A?R?G?S?)?", text)):
                self.pending = text         # maybe a separator or a name still arriving
                return ""
            if self.kind in ("required", "named"):
                return ""                   # the grammar allows nothing else; ignore
            self.in_calls = False           # text after the calls: content again
            return text

    def finish(self) -> list:
        """Flush what was held back. A call cut off mid-object keeps what was sent; one
        whose head never arrived is returned as text."""
        out: list = []
        if self.call is not None and not self.call.announced:
            self._say(self.call.buf, out)
            self.count -= 1
        elif self.call is not None:
            self.call.args_end = len(self.call.buf)
            self.call._send_args(out)
        self.call = None
        if self.pending and (not self.in_calls or self.kind in PARSERS):
            self._say(self.pending, out)
        self.pending = ""
        return out


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own tool format calls for (hermes by default: the
    format streamgate describes to a model whose template has no tools)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and "<tool_call>" not in t):
        return "llama3_json"
    return "hermes"
