"""The tokenizer threads: chat template and tokenizer off the event loop (`Tokenizers`),
each tenant at most `per_tenant` jobs at a time, and the bounds that let admission refuse a
prompt that cannot fit without tokenizing it (`Tokenizers.min_tokens`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import queue

from .control_tokens import break_token, control_tokens
from .prompts import chat_template, fim_format


class Tokenizers:
    """Chat template + tokenizer on `workers` threads, at most `per_tenant` jobs per tenant.

    A job whose caller gives up (client gone) keeps its tenant's place until the thread
    finishes, so hanging up and retrying cannot pile work into the pool."""

    def __init__(self, tokenizer, *, workers: int = 2, per_tenant: int = 1):
        # One copy per worker, made now (off the event loop): HF tokenizers are not thread-safe.
        self.copies: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            self.copies.put(copy.deepcopy(tokenizer))
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="streamgate-tokenize")
        self.per_tenant = per_tenant
        self.tenant_slots: dict[str, asyncio.Semaphore] = {}
        self.max_token_chars = max_token_chars(tokenizer)
        self.template_bytes = template_bytes(tokenizer)
        self.control = control_tokens(tokenizer)
        self.template = chat_template(tokenizer)
        self.fim = fim_format(tokenizer)

    def estimate_prompt(self, messages) -> int | None:
        """The prompt's tokens estimated before rendering, in time that grows with the number
        of messages, not their length: one token per byte of the rendered text (no token is shorter in a byte-level or
        character vocabulary), the template's bytes measured at start-up, each character
        counted as 4 bytes unless the text is ASCII (`isascii` is O(1)). None if the template
        could not be measured. A template that adds more than it did for empty messages
        makes this low: that only costs a second round trip, never a limit."""
        if self.template_bytes is None:
            return None
        fixed, per_message = self.template_bytes
        n = fixed + per_message * len(messages)
        for m in messages:
            text = m.text()
            n += len(text) if text.isascii() else 4 * len(text)
        return n

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`: no token stands for more than
        `max_token_chars` characters. 0 (no bound) for a tokenizer with a normalizer,
        which could shorten the text first."""
        return 0 if self.max_token_chars is None else -(-len(text) // self.max_token_chars)

    async def run(self, tenant: str, fn, *args):
        loop = asyncio.get_running_loop()
        slot = self.tenant_slots.setdefault(tenant, asyncio.Semaphore(self.per_tenant))
        await slot.acquire()
        try:
            job = self.pool.submit(fn, *args)
        except BaseException:
            slot.release()
            raise
        job.add_done_callback(lambda _: _call_soon(loop, slot.release))
        return await asyncio.wrap_future(job)

    def render(self, messages: list[dict], kw: dict | None = None) -> str:
        """The prompt text. A control token's text inside a message (`<|im_start|>system`
        typed by a user) is broken with a zero-width space first, so that it is tokenized
        as the text it is, never as the control token the template itself writes."""
        if self.control is not None:
            messages = [{**m, "content": self.control.sub(break_token, m["content"])}
                        if isinstance(m.get("content"), str) else m for m in messages]
        return self._with_copy(lambda t: t.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                               **(kw or {})))

    def encode(self, text: str) -> list[int]:
        return self._with_copy(lambda t: list(t(text, add_special_tokens=False)["input_ids"]))

    def _with_copy(self, fn):
        tokenizer = self.copies.get()
        try:
            return fn(tokenizer)
        finally:
            self.copies.put(tokenizer)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn) -> None:
    with contextlib.suppress(RuntimeError):         # the loop closed (shutdown)
        loop.call_soon_threadsafe(fn)


def max_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for. A token string has one character per
    byte (byte-level BPE) or per character, never fewer than the text it decodes to."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    vocab = tokenizer.get_vocab()
    return max(len(token) for token in vocab) or None


def template_bytes(tokenizer) -> tuple[int, int] | None:
    """The bytes the chat template adds around the messages' text, (fixed, per message),
    from rendering empty conversations of one and three messages; None if it refuses them."""
    def size(n: int) -> int:
        messages = [{"role": ("user", "assistant")[i % 2], "content": ""} for i in range(n)]
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).encode())
    try:
        one, three = size(1), size(3)
    except Exception:           # a template that needs content, tools, ...: no estimate
        return None
    per_message = -(-max(0, three - one) // 2)
    return max(0, one - per_message), per_message
