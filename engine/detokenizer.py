"""Incremental detokenization and stop-string handling for one streaming request.

Decoding token by token and concatenating goes wrong in two ways: SentencePiece-style
tokenizers drop the leading space of the first token they decode ("▁world" alone gives
"world"), and byte-level tokenizers split one UTF-8 character over several tokens, each
of which decodes to "\\ufffd" alone. As in vLLM, we keep a small window of ids (a few
already-read "prefix" tokens followed by the unread ones), decode prefix and window, and
emit the difference once it no longer ends in a partial character.

Stop strings are applied on top of that text: a stop string and everything after it is
never emitted, and a tail that could still grow into a stop string is held back.
The stop chosen is the one that completes first (smallest end index; for equal ends the
longest), so the result does not depend on how the text was split into tokens.

Per-token cost is one or two decodes of the window (a few tokens) plus stop-string
checks over at most (max stop length + new text) characters; it does not depend on how
long the output already is.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
# Prompt tokens used as decoding context for the first generated token (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
# A window that has not produced clean text after this many unread tokens (e.g. a model
# emitting a long run of invalid bytes) is emitted as is, so the window stays bounded.
MAX_PENDING_TOKENS = 32


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    `tokenizer` is a Hugging Face tokenizer (anything with `decode(ids,
    skip_special_tokens=..., clean_up_tokenization_spaces=...)`). Prompt text is never
    emitted; the prompt's last tokens only serve as context.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(dict.fromkeys(s for s in stop if s))   # drop "", dedupe
        self._max_stop = max((len(s) for s in self._stops), default=0)
        # Special ids that decode to nothing never enter the window (same text, smaller window).
        self._skip_ids: frozenset[int] = frozenset()
        if skip_special_tokens:
            special = getattr(tokenizer, "all_special_ids", None) or ()
            self._skip_ids = frozenset(i for i in special if self._decode([i]) == "")
        context, prefix_text = self._prompt_context(list(prompt_token_ids))
        self._ids: list[int] = context            # the window: prefix ids + unread ids
        self._read = len(context)                 # ids[:read] is the prefix
        self._prefix_text = prefix_text           # decode(ids[:read]), cached
        self._held = ""                           # decoded text held back for stop strings
        self._chunks: list[str] = []              # emitted deltas
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; nothing more is emitted after that."""
        return self._stopped

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the new text that is safe to emit now (may be "")."""
        if self._stopped or token_id in self._skip_ids:
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids)
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(self._prefix_text):
            # Partial character (or no new text yet): wait for more tokens, within reason.
            if len(self._ids) - self._read <= MAX_PENDING_TOKENS:
                return ""
            delta = new_text[len(self._prefix_text):]
            self._ids, self._read, self._prefix_text = [], 0, ""
            return self._emit(delta, final=False)
        delta = new_text[len(self._prefix_text):]
        # The tokens just read become the prefix (context) for the next ones.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._emit(delta, final=False)

    def flush(self) -> str:
        """The request finished for a reason other than a stop string: return any text
        still held back (a trailing partial character is emitted as decoded, i.e. as
        "\\ufffd", matching a full decode). Calling it again returns ""."""
        if self._stopped:
            return ""
        delta = ""
        if len(self._ids) > self._read:
            delta = self._decode(self._ids)[len(self._prefix_text):]
        self._ids, self._read, self._prefix_text = [], 0, ""
        return self._emit(delta, final=True)

    # -- internals ------------------------------------------------------------------

    def _prompt_context(self, prompt: list[int]) -> tuple[list[int], str]:
        """The longest tail of the prompt (at most PROMPT_CONTEXT_TOKENS) that decodes
        without a replacement character, and its text. A tail starting or ending inside a
        multi-byte character is skipped: byte-fallback decoders turn a whole run of byte
        tokens into "\ufffd"s when the run is not valid UTF-8, which would also swallow
        the generated bytes appended to it."""
        for n in range(min(PROMPT_CONTEXT_TOKENS, len(prompt)), 0, -1):
            text = self._decode(prompt[-n:])
            if _REPLACEMENT not in text:
                return prompt[-n:], text
        return [], ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(ids, skip_special_tokens=self._skip,
                                clean_up_tokenization_spaces=False)

    def _emit(self, new: str, final: bool) -> str:
        """Run `new` text through the stop-string filter; record and return what may go out."""
        buf = self._held + new
        self._held = ""
        if not buf:
            return ""
        if self._stops:
            # Only held text + new text can contain a match: any earlier suffix that could
            # start a stop string was held back, so it is part of `buf`.
            best = None                                  # (end, -len) of the first completion
            for s in self._stops:
                i = buf.find(s)
                if i >= 0 and (best is None or (i + len(s), -len(s)) < best):
                    best = (i + len(s), -len(s))
            if best is not None:
                self._stopped = True
                return self._record(buf[:best[0] + best[1]])
            if not final:
                keep = self._partial_stop_len(buf)
                if keep:
                    self._held = buf[-keep:]
                    buf = buf[:-keep]
        return self._record(buf)

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_stop - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def _record(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta
