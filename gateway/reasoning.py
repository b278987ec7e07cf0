"""Reasoning models' `<think>…</think>` blocks split from the answer, incrementally:
`ReasoningSplitter.feed(text)` returns `(reasoning, content)` pieces; `finish()` flushes.

A block counts only at the start of the answer (after whitespace), or from the first
token when the chat template already opened it (the prompt ends with `<think>`, as
DeepSeek-R1's and Qwen3's thinking templates do). Text held back is at most the length of
a tag, while it could still be one.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool = False):
        self.state = "think" if in_reasoning else "start"
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        text = self.pending + text
        self.pending = ""
        reasoning = content = ""
        if self.state == "start":
            stripped = text.lstrip()
            if stripped.startswith(OPEN):
                self.state, text = "think", stripped[len(OPEN):]
            elif OPEN.startswith(stripped):         # could still become "<think>" (or is blank)
                self.pending = text
                return "", ""
            else:
                self.state = "answer"
        if self.state == "think":
            at = text.find(CLOSE)
            if at < 0:
                keep = next((k for k in range(len(CLOSE) - 1, 0, -1) if text.endswith(CLOSE[:k])), 0)
                self.pending = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
            reasoning, text = text[:at], text[at + len(CLOSE):].lstrip()
            self.state = "after" if not text else "answer"
        if self.state == "after":                   # drop the blank line after </think>
            text = text.lstrip()
            if not text:
                return reasoning, ""
            self.state = "answer"
        return reasoning, content + text

    def finish(self) -> tuple[str, str]:
        pending, self.pending = self.pending, ""
        if self.state == "think":
            return pending, ""
        return "", pending
