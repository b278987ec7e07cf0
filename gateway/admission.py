"""Admission: parse → take the tenant's slot and request (with an estimate of its tokens)
→ render and tokenize off the event loop → clamp to the tenant's limits → deadline →
reserve the exact tokens (no round trip when the estimate was taken and covers them).

Nothing here does work on the event loop that grows with the prompt: the chat template
and the tokenizer run in a small thread pool (`Tokenizers`), each tenant at most
`per_tenant` jobs at a time, and a prompt that cannot fit is refused after rendering by a
bound that needs no tokenizing (`Tokenizers.min_tokens`). The request counts against the
tenant's `max_concurrent` and `requests_per_minute` before any of that work starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import queue
import time
import uuid
from dataclasses import dataclass, field

from engine import EngineClient, EngineOverloaded, SamplingParams
from tenants import Lease, QuotaBackend, QuotaBackendUnavailable, QuotaExceeded, Tenant

from .control_tokens import break_token, control_tokens
from .errors import BadRequest, ContextLengthExceeded, Overloaded, QuotaStoreUnavailable, RateLimited
from .prompts import chat_template, fim_format, render_prompt
from .schemas import REQUEST_KINDS, ChatRequest, parse_body
from .tools import engine_refusal, output_grammar, sampling_params


@dataclass
class Admission:
    request_id: str
    tenant: Tenant
    request: ChatRequest
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    deadline: float | None      # absolute, on the engine's clock (time.monotonic)
    lease: Lease
    transport: str
    arrival: float
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    cancelled: bool = False
    billed: int | None = None   # set once the lease is settled
    prompt_text: str | None = None      # the rendered prompt (None: the client sent token ids)


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


class Admitter:
    def __init__(self, engine: EngineClient, quotas: QuotaBackend, *, model_name: str, default_max_tokens: int,
                 clock, tokenize_workers: int = 2):
        self.engine = engine
        self.quotas = quotas
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.clock = clock
        self.tokenize_workers = tokenize_workers
        self.tokenizers: Tokenizers | None = None
        self.max_model_len = 0
        self._grammar_field: str | None = None

    def on_engine_started(self) -> None:
        """Slow (the vocabulary is scanned): run it off the event loop."""
        # The gateway's own copies: the engine thread decodes with its tokenizer.
        self.tokenizers = Tokenizers(self.engine.tokenizer, workers=self.tokenize_workers)
        self.max_model_len = self.engine.limits.max_model_len

    def precheck(self, tenant: Tenant) -> None:
        """The quota's refusal, if it would refuse now, as a GatewayError (nothing taken)."""
        precheck = getattr(self.quotas, "precheck", None)
        if precheck is None:
            return
        try:
            precheck(tenant)
        except QuotaExceeded as exc:
            raise RateLimited(str(exc), reason=exc.reason, retry_after=exc.retry_after, headers=exc.headers) from None
        except QuotaBackendUnavailable as exc:
            raise QuotaStoreUnavailable(str(exc), retry_after=exc.retry_after) from None

    async def admit(self, tenant: Tenant, body: object, *, transport: str, timeout_s: float | None,
                    request_id: str | None, kind: str = "chat") -> Admission:
        arrival = self.clock()
        req = parse_body(REQUEST_KINDS[kind], body)
        if req.model not in (None, "", self.model_name, "default"):
            raise BadRequest(f"model: unknown model {req.model!r}; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")
        deadline = self._deadline(tenant, req, timeout_s, arrival)
        lease = await self._reserve(self.quotas.begin(tenant, self._estimate(tenant, req)))
        try:
            text, prompt_ids = await self._tokenize(tenant, req)
            params, max_tokens = self._params(tenant, req, len(prompt_ids))
            priority = tenant.priority if req.priority is None else max(tenant.priority, req.priority)
            rid = request_id or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            try:
                self.engine.validate(rid, prompt_ids, params, priority=priority, deadline=deadline,
                                     weight=tenant.weight)
            except EngineOverloaded as exc:
                raise Overloaded(f"the engine is overloaded ({exc}); retry later",
                                 retry_after=exc.retry_after) from None
            except ValueError as exc:
                raise engine_refusal(exc, self._grammar_field) from None
            await self._reserve(lease.reserve_tokens(len(prompt_ids) + req.n * max_tokens))
        except BaseException:
            lease.settle(0)
            raise
        return Admission(rid, tenant, req, prompt_ids, params, priority, deadline, lease, transport, arrival,
                         self.model_name, prompt_text=text)

    def _estimate(self, tenant: Tenant, req: ChatRequest) -> int:
        """What `reserve_tokens` will ask (prompt + max_tokens) estimated before any work on
        the prompt, for `begin` (the Redis backend takes it in the same round trip). An
        admitted request never holds more than the context, nor a prompt over the tenant's
        max_prompt_tokens. 0: no estimate."""
        messages = getattr(req, "messages", None)
        if messages is None:
            prompt = len(req.prompt) if isinstance(req.prompt, list) or req.prompt.isascii() else 4 * len(req.prompt)
        else:
            prompt = self.tokenizers.estimate_prompt(messages) if self.tokenizers else None
        if prompt is None:
            return 0
        if tenant.limits.max_prompt_tokens is not None:
            prompt = min(prompt, tenant.limits.max_prompt_tokens)
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            max_tokens = tenant.limits.max_tokens if tenant.limits.max_tokens is not None else self.default_max_tokens
        return min(self.max_model_len, prompt + max_tokens) + (req.n - 1) * max_tokens

    @staticmethod
    async def _reserve(step):
        try:
            return await step
        except QuotaExceeded as exc:
            raise RateLimited(str(exc), reason=exc.reason, retry_after=exc.retry_after, headers=exc.headers) from None
        except QuotaBackendUnavailable as exc:
            raise QuotaStoreUnavailable(str(exc), retry_after=exc.retry_after) from None

    async def _tokenize(self, tenant: Tenant, req) -> tuple[str | None, list[int]]:
        """(the rendered prompt or None, its token ids): chat template and tokenizer on the
        tokenizer threads (gateway/prompts.py), or the ids a completions client sent."""
        tok = self.tokenizers
        field = "messages" if hasattr(req, "messages") else "prompt"
        text, ids = await render_prompt(tok, tenant.name, req)
        if ids is None:
            self._check_prompt(tenant, tok.min_tokens(text), at_least=True, field=field)
            ids = await tok.run(tenant.name, tok.encode, text)
        self._check_prompt(tenant, len(ids), at_least=False, field=field)
        return text, ids

    def _check_prompt(self, tenant: Tenant, n: int, *, at_least: bool, field: str = "messages") -> None:
        has = f"has at least {n}" if at_least else f"has {n}"
        cap = tenant.limits.max_prompt_tokens
        if cap is not None and n > cap:
            raise ContextLengthExceeded(f"{field}: the prompt {has} tokens; tenant {tenant.name!r} "
                                        f"allows at most {cap}", param=field)
        if n >= self.max_model_len:
            raise ContextLengthExceeded(f"{field}: the prompt {has} tokens but the model's context is "
                                        f"{self.max_model_len}", param=field)

    def _params(self, tenant: Tenant, req: ChatRequest, n_prompt: int) -> tuple[SamplingParams, int]:
        limits = tenant.limits
        room = self.max_model_len - n_prompt
        asked, cap = req.requested_max_tokens, limits.max_tokens
        if asked is not None:
            if cap is not None and asked > cap:
                raise BadRequest(f"max_tokens: {asked} is above tenant {tenant.name!r}'s limit of {cap}",
                                 param="max_tokens")
            if asked > room:
                raise ContextLengthExceeded(
                    f"max_tokens: the prompt has {n_prompt} tokens and max_tokens is {asked}, but the model's "
                    f"context is {self.max_model_len}", param="max_tokens")
            max_tokens = asked
        else:
            max_tokens = min(room, cap if cap is not None else self.default_max_tokens)
            max_tokens = min(max_tokens, getattr(req, "default_max_tokens", max_tokens))    # completions: 16
            if limits.tokens_per_minute is not None:       # a default that the tpm bucket can hold
                max_tokens = max(1, min(max_tokens, limits.tokens_per_minute - n_prompt))
        grammar, self._grammar_field = output_grammar(req) if isinstance(req, ChatRequest) else (None, None)
        return sampling_params(req, max_tokens, grammar, req.num_top_logprobs), max_tokens

    @staticmethod
    def _deadline(tenant: Tenant, req: ChatRequest, timeout_s: float | None, arrival: float) -> float | None:
        """The earliest of the body's `deadline_ms`, the transport's timeout and the
        tenant's bound, as an absolute time."""
        wanted_ms: float | None = req.deadline_ms
        if timeout_s is not None:
            wanted_ms = timeout_s * 1000 if wanted_ms is None else min(wanted_ms, timeout_s * 1000)
        bound = tenant.limits.deadline_ms
        if bound is not None:
            wanted_ms = bound if wanted_ms is None else min(wanted_ms, bound)
        return None if wanted_ms is None else arrival + wanted_ms / 1000
