"""A choice's raw text as the API shows it: `<think>` blocks split into reasoning
(gateway/reasoning.py), tool calls parsed out (gateway/tool_parsers.py), logprobs with token
strings. `ChoiceFormat.feed(text)` returns pieces, ("reasoning", text), ("content", text)
or ToolCallDelta, that the transports render (chat SSE and JSON here, WebSocket frames in
ws_format.py, Responses events in responses.py)."""

from __future__ import annotations

import json

from .harmony import HarmonyParser
from .prompts import starts_in_reasoning
from .reasoning import ReasoningSplitter
from .tool_parsers import ToolCallDelta, ToolCallParser


# Characters valid raw in a JSON string that Python's str.splitlines() (and so httpx's
# iter_lines, which GuideLLM and other SSE clients read streams with) takes for line ends:
# raw in an SSE data line they cut it, and the client fails to decode the half it got.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event_json(body: object) -> str:
    """An SSE event's JSON: UTF-8 text as is, except U+0085, U+2028 and U+2029 escaped (the
    same JSON; control characters json.dumps escapes itself)."""
    return json.dumps(body, ensure_ascii=False).translate(_LINE_BREAKS)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: token string characters -> bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


BYTE_DECODER = _byte_decoder()


class TokenText:
    """Token id -> (text, bytes) for logprobs, cached. Byte-level vocabularies give each
    token's exact bytes (a token may hold part of a UTF-8 character).

    It reads the engine's tokenizer from the event loop: id -> token lookups and decoding
    only take the Rust tokenizer shared, as the engine thread's detokenizer does (what is
    unsafe across threads is encoding, which changes its padding and truncation state);
    a private copy would cost ~0.4 s of the loop for SmolLM2's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            if all(c in BYTE_DECODER for c in piece):
                raw = bytes(BYTE_DECODER[c] for c in piece)
            else:
                raw = self.tokenizer.decode([token_id]).encode()
            hit = self.cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self.cache) > 200_000:
                self.cache.clear()
        return hit


def token_text(gw) -> TokenText:
    tt = getattr(gw, "token_text", None)
    if tt is None:
        tt = gw.token_text = TokenText(gw.engine.tokenizer)
    return tt


def chat_logprobs(tt: TokenText, lps) -> list[dict]:
    """Engine TokenLogprobs as OpenAI chat `logprobs.content` entries."""
    out = []
    for lp in lps or ():
        text, raw = tt(lp.token_id)
        top = []
        for tid, value in lp.top:
            t, b = tt(tid)
            top.append({"token": t, "logprob": value, "bytes": b})
        out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return out


class ChoiceFormat:
    """One choice's output, streamed (`feed`, `finish`) and accumulated (`message`)."""

    def __init__(self, adm, parser: str | None):
        req = adm.request
        self.separate = getattr(req, "separate_reasoning", False)
        self.reasoning = ReasoningSplitter(starts_in_reasoning(adm.prompt_text)) if self.separate else None
        forced = getattr(req, "forced_tool", None)
        self.harmony = HarmonyParser() if parser == "harmony" and forced is None else None
        if self.harmony is not None:
            self.reasoning = self.tools = None
        elif forced == "required":
            self.tools = ToolCallParser("required")
        elif forced is not None:
            self.tools = ToolCallParser("named", forced)
        elif getattr(req, "tools_on", False):
            self.tools = ToolCallParser(parser or "hermes")
        else:
            self.tools = None
        self.content: list[str] = []
        self.reasoning_text: list[str] = []
        self.calls: dict[int, dict] = {}
        self.logprobs: list[dict] = []

    def feed(self, text: str) -> list:
        if self.harmony is not None:
            return self._record(self.harmony.feed(text))
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._pieces(reasoning, content, final=False)

    def finish(self) -> list:
        if self.harmony is not None:
            return self._record(self.harmony.finish())
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._pieces(reasoning, content, final=True)

    def _record(self, items: list) -> list:
        """Harmony's pieces, kept for `message()` (reasoning inline when not separated)."""
        out: list = []
        for item in items:
            if isinstance(item, tuple) and item[0] == "reasoning":
                if self.separate:
                    self.reasoning_text.append(item[1])
                    out.append(item)
                    continue
                item = item[1]
            out += self._items([item[1] if isinstance(item, tuple) else item])
        return out

    def _pieces(self, reasoning: str, content: str, *, final: bool) -> list:
        pieces: list = []
        if reasoning:
            pieces.append(("reasoning", reasoning))
            self.reasoning_text.append(reasoning)
        items = [] if not content else self.tools.feed(content) if self.tools else [content]
        if final and self.tools:
            items += self.tools.finish()
        return pieces + self._items(items)

    def _items(self, items: list) -> list:
        """Content strings and ToolCallDeltas as pieces, accumulated."""
        pieces: list = []
        for item in items:
            if isinstance(item, str):
                if item:
                    pieces.append(("content", item))
                    self.content.append(item)
                continue
            call = self.calls.setdefault(item.index, {"id": item.id, "type": "function",
                                                      "function": {"name": item.name, "arguments": ""}})
            call["function"]["arguments"] += item.arguments
            pieces.append(item)
        return pieces

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict:
        msg: dict = {"role": "assistant", "content": "".join(self.content) if self.content or not self.calls else None}
        if self.reasoning_text:
            msg["reasoning_content"] = "".join(self.reasoning_text)
        if self.calls:
            msg["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return msg


def delta_dict(pieces: list) -> dict:
    """Pieces as an OpenAI chat chunk's `delta`."""
    d: dict = {}
    for piece in pieces:
        if isinstance(piece, ToolCallDelta):
            d.setdefault("tool_calls", []).append(piece.as_dict())
        else:
            key = "reasoning_content" if piece[0] == "reasoning" else "content"
            d[key] = d.get(key, "") + piece[1]
    return d
