"""gpt-oss's harmony output split into reasoning, content and tool calls, incrementally:
`HarmonyParser.feed(text)` returns ChoiceFormat's pieces — ("reasoning", text),
("content", text) or ToolCallDelta — and `finish()` flushes.

The model writes messages, each a header and a body:

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

`analysis` is reasoning, `final` (and `commentary` without a recipient: a preamble to the
user) is content, a message addressed `to=functions.NAME` (in the header's channel part
or its role part) is a call whose arguments are the body. A body ends at `<|end|>`,
`<|call|>`, `<|return|>` or the next `<|start|>`; `<|call|>` and `<|return|>` are the
model's stop tokens, so the text usually just ends. Text that opens with no header (a
model that does not write harmony) is content; text between messages is not shown.

This parses text, not token ids: the `openai-harmony` package's StreamableParser reads ids
of its own o200k vocabulary, which it downloads at first use (no network here), and the
served tokenizer may be another; the engine keeps special tokens in the text for a
harmony model (SamplingParams.skip_special_tokens False) so the markers arrive whole.
"""

from __future__ import annotations

import re

from .tool_parsers import ToolCallDelta, new_call_id

MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_MARKERS = _ENDS + (MESSAGE, "<|channel|>", "<|constrain|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def is_harmony_template(template: str | None) -> bool:
    return "<|channel|>" in (template or "")


def _held(text: str) -> int:
    """Characters at the end of `text` that could still grow into a marker."""
    at = text.rfind("<")
    if at < 0 or ">" in text[at:]:
        return 0
    tail = text[at:]
    return len(tail) if any(m.startswith(tail) for m in _MARKERS) else 0


class HarmonyParser:
    def __init__(self):
        self.in_body = False
        self.seen = False           # a header was read: the output is harmony
        self.head = ""              # the header being read
        self.pending = ""           # a body's tail that may be the start of a marker
        self.kind = "content"       # the current body: reasoning | content | call
        self.calls = 0
        self.call: ToolCallDelta | None = None

    def feed(self, text: str) -> list:
        out: list = []
        text = self.pending + text
        self.pending = ""
        while text:
            text = self._body(text, out) if self.in_body else self._header(text)
        return out

    def _header(self, text: str) -> str:
        self.head += text
        at = self.head.find(MESSAGE)
        if at >= 0:
            head, rest = self.head[:at], self.head[at + len(MESSAGE):]
            self.head = ""
            self._open(head)
            return rest
        stripped = self.head.lstrip()
        if not self.seen and stripped and not stripped.startswith("<|") and not "<|".startswith(stripped):
            rest, self.head = self.head, ""                 # no header: plain content
            self.in_body, self.kind = True, "content"
            return rest
        return ""

    def _open(self, head: str) -> None:
        channel = _CHANNEL.search(head)
        recipient = _RECIPIENT.search(head)
        self.in_body = self.seen = True
        if recipient is not None:
            name = recipient.group(1)
            name = name[len("functions."):] if name.startswith("functions.") else name
            self.kind = "call"
            self.call = ToolCallDelta(self.calls, new_call_id(), name, "")
            self.calls += 1
        else:
            self.kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    def _body(self, text: str, out: list) -> str:
        hits = [(text.find(m), m) for m in _ENDS if m in text]
        if hits:
            at, marker = min(hits)
            self._say(text[:at], out)
            self._close(out)
            return text[at + (len(marker) if marker != "<|start|>" else 0):]
        keep = _held(text)
        self._say(text[:len(text) - keep], out)
        self.pending = text[len(text) - keep:]
        return ""

    def _say(self, text: str, out: list) -> None:
        if self.kind == "call":
            if self.call is not None:                       # the call's first delta: id and name
                out.append(self.call)
                self.call = None
            if text:
                out.append(ToolCallDelta(self.calls - 1, arguments=text))
        elif text:
            out.append((self.kind, text))

    def _close(self, out: list) -> None:
        if self.kind == "call":
            self._say("", out)                              # a call with empty arguments still counts
        self.in_body, self.kind = False, "content"

    def finish(self) -> list:
        out: list = []
        pending, self.pending = self.pending, ""
        if self.in_body:
            self._say(pending, out)
            self._close(out)
        self.head = ""                                      # a header cut off: nothing to show
        return out
