"""WebSocket frames for one chat request's events (docs/PROTOCOL.md, section 4.3):
`chat.delta` {id, text, num_tokens} gains `reasoning`, `tool_calls` (OpenAI's delta items),
`logprobs` (chat's entries) and, with `n` > 1, `index` and a choice's `finish_reason`;
each completed call is repeated whole as `chat.tool_call` {id, index, tool_call} before
`chat.done`, whose `finish_reason` is `tool_calls` when the model called tools and which
lists every choice's end in `choices` when `n` > 1."""

from __future__ import annotations

from .chat_api import choice_parser, choice_reason
from .chat_format import ChoiceFormat, chat_logprobs, token_text
from .streaming import Delta, Done
from .tool_parsers import ToolCallDelta


class WsFrames:
    def __init__(self, gw, adm, cid):
        req = adm.request
        self.cid, self.n = cid, req.n
        parser = choice_parser(gw, req)
        self.formats = [ChoiceFormat(adm, parser) for _ in range(req.n)]
        self.tt = token_text(gw) if req.logprobs else None
        self.ended = [False] * req.n

    def delta(self, event: Delta) -> list[dict]:
        fmt = self.formats[event.index]
        frame = self._frame(event.index, fmt.feed(event.text), event.num_tokens)
        if self.tt is not None and event.logprobs:
            frame["logprobs"] = chat_logprobs(self.tt, event.logprobs)
        frames = [frame] if self._worth_sending(frame) else []
        if event.finish_reason is not None:
            frames += self._end(event.index, event.finish_reason)
        return frames

    def done(self, event: Done) -> list[dict]:
        frames = []
        for i in range(self.n):
            if not self.ended[i]:
                frames += self._end(i, choice_reason(event, i))
        fmt = self.formats[0]
        reason0 = choice_reason(event, 0)
        done = {"type": "chat.done", "id": self.cid, "finish_reason": fmt.finish_reason(reason0),
                "usage": event.usage.as_dict(), "timings": event.timings}
        if self.n > 1:
            done["choices"] = [{"index": i, "finish_reason": f.finish_reason(choice_reason(event, i))}
                                for i, f in enumerate(self.formats)]
        return frames + [done]

    def _frame(self, index: int, pieces: list, num_tokens: int) -> dict:
        frame: dict = {"type": "chat.delta", "id": self.cid, "text": "", "num_tokens": num_tokens}
        if self.n > 1:
            frame["index"] = index
        for piece in pieces:
            if isinstance(piece, ToolCallDelta):
                frame.setdefault("tool_calls", []).append(piece.as_dict())
            elif piece[0] == "reasoning":
                frame["reasoning"] = frame.get("reasoning", "") + piece[1]
            else:
                frame["text"] += piece[1]
        return frame

    @staticmethod
    def _worth_sending(frame: dict) -> bool:
        return bool(frame["text"] or frame["num_tokens"] or len(frame) > 4 + ("index" in frame))

    def _end(self, index: int, reason: str) -> list[dict]:
        self.ended[index] = True
        fmt = self.formats[index]
        frames = []
        frame = self._frame(index, fmt.finish(), 0)
        if self._worth_sending(frame):
            frames.append(frame)
        for i in sorted(fmt.calls):
            call = {"type": "chat.tool_call", "id": self.cid, "tool_call": fmt.calls[i]}
            if self.n > 1:
                call["index"] = index
            frames.append(call)
        if self.n > 1:
            frames.append({"type": "chat.delta", "id": self.cid, "index": index, "text": "", "num_tokens": 0,
                           "finish_reason": fmt.finish_reason(reason)})
        return frames
