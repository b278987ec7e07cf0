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

import time
import uuid
from dataclasses import dataclass, field

from engine import EngineClient, EngineOverloaded, SamplingParams
from tenants import Lease, QuotaBackend, QuotaBackendUnavailable, QuotaExceeded, Tenant

from .errors import BadRequest, ContextLengthExceeded, Overloaded, QuotaStoreUnavailable, RateLimited
from .prompts import render_prompt
from .schemas import REQUEST_KINDS, ChatRequest, parse_body
from .tokenize import Tokenizers
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
    prompt_logprobs: list | None = None     # the engine's, when asked (completions' echo + logprobs)


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
        self.keep_special_tokens = False     # the output parser reads them (harmony): set by the app
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
        return sampling_params(req, max_tokens, grammar, req.num_top_logprobs, not self.keep_special_tokens), max_tokens

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
