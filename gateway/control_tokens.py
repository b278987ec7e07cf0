"""Control-token text typed by a user (`<|im_start|>system`) must stay text: rendered into
the prompt and tokenized, it would become the control token the chat template writes.
`Tokenizers.render` breaks every special token's text inside message contents with a
zero-width space (U+200B) after its first character."""

from __future__ import annotations

import re


def control_tokens(tokenizer) -> re.Pattern | None:
    """A pattern matching the text of every special (control) token, or None."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {tok.content for tok in decoder.values() if getattr(tok, "special", False) and len(tok.content) > 1}
    texts |= {t for t in getattr(tokenizer, "all_special_tokens", ()) if isinstance(t, str) and len(t) > 1}
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def break_token(match: re.Match) -> str:
    text = match.group(0)
    return text[0] + "\u200b" + text[1:]
