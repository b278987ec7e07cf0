"""The chat pipeline, transport-free: admit → reserve → generate under the deadline → settle.

`ChatService.admit()` turns an authenticated tenant and a request body into an
`Admission` (or raises a GatewayError before anything is reserved or queued). `run()` is
an async generator of `Delta` events ending with exactly one `Done` or `Failed`; however
it ends — finish, cancel, disconnect (the consumer closes or cancels it), deadline,
shutdown, error — its `finally` returns the quota lease with the tokens actually used.
`sse.py` and `ws.py` only translate these events to their wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from engine import EngineOverloaded, SamplingParams
from tenants import Lease, QuotaExceeded, QuotaManager, Tenant

from .live import ItlWindow
from .errors import (BadRequest, ContextLengthExceeded, DeadlineExceeded, Draining, GatewayError,
                     InternalError, Overloaded, RateLimited, Unavailable)
from .schemas import MAX_DEADLINE_MS, ChatRequest, parse_chat_request

log = structlog.get_logger("streamgate.gateway")

CLIENT_CLOSED = 499     # nginx's "client closed request", for metrics and logs


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass
class Delta:
    text: str
    num_tokens: int


@dataclass
class Done:
    finish_reason: str          # stop | length | abort (cancelled by the client)
    usage: Usage
    timings: dict


@dataclass
class Failed:
    error: GatewayError
    usage: Usage
    timings: dict
    before_first_token: bool


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


class ChatService:
    def __init__(self, engine, quotas: QuotaManager, metrics, *, model_name: str,
                 default_max_tokens: int = 1024, clock=time.monotonic):
        self.engine = engine            # an AsyncEngine, started by the app's lifespan
        self.quotas = quotas
        self.metrics = metrics
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.clock = clock
        self.draining = False
        self.ready = False
        self.tokenizer = None           # the gateway's own copy: the engine thread decodes with its own
        self.max_model_len = 0
        self.active: dict[str, Admission] = {}
        self.itl = ItlWindow(clock=clock)
        self._shutdown_ids: set[str] = set()

    def on_engine_started(self) -> None:
        self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        self.max_model_len = self.engine.engine.max_model_len
        self.ready = True

    # -- admission ---------------------------------------------------------------------------
    def admit(self, tenant: Tenant, body: object, *, transport: str, timeout_header: str | None = None,
              request_id: str | None = None) -> Admission:
        """Validate, tokenize, clamp to the tenant's limits and reserve quota. Raises a
        GatewayError (and reserves nothing) when the request cannot be served."""
        try:
            return self._admit(tenant, body, transport, timeout_header, request_id)
        except GatewayError as exc:
            self.metrics.request_done(tenant.name, transport, exc.status)
            if isinstance(exc, RateLimited):
                self.metrics.rate_limited(tenant.name, exc.reason)
            log.info("chat.refused", tenant=tenant.name, transport=transport, status=exc.status, code=exc.code)
            raise

    def _admit(self, tenant, body, transport, timeout_header, request_id) -> Admission:
        arrival = self.clock()
        if self.draining:
            raise Draining("the server is shutting down and accepts no new requests")
        if not self.ready:
            raise Overloaded("the model is still loading", retry_after=5.0)
        if self.engine.error is not None:
            raise Unavailable(f"the engine failed ({type(self.engine.error).__name__}); the server needs a restart")
        req = parse_chat_request(body)
        if req.model not in (None, "", self.model_name, "default"):
            raise BadRequest(f"model: unknown model {req.model!r}; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")
        prompt_ids = self._tokenize(req)
        limits = tenant.limits
        n_prompt = len(prompt_ids)
        if limits.max_prompt_tokens is not None and n_prompt > limits.max_prompt_tokens:
            raise ContextLengthExceeded(f"messages: the prompt has {n_prompt} tokens; tenant {tenant.name!r} "
                                        f"allows at most {limits.max_prompt_tokens}", param="messages")
        room = self.max_model_len - n_prompt
        if room < 1:
            raise ContextLengthExceeded(f"messages: the prompt has {n_prompt} tokens but the model's context is "
                                        f"{self.max_model_len}", param="messages")
        asked = req.requested_max_tokens
        cap = limits.max_tokens
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
            if limits.tokens_per_minute is not None:       # a default that the tpm bucket can hold
                max_tokens = max(1, min(max_tokens, limits.tokens_per_minute - n_prompt))
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                top_k=req.top_k, seed=req.seed, stop=tuple(req.stop or ()),
                                ignore_eos=req.ignore_eos)
        # A request may lower its urgency (a larger class number) but never raise it.
        priority = tenant.priority if req.priority is None else max(tenant.priority, req.priority)
        deadline = self._deadline(tenant, req, timeout_header, arrival)
        rid = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        try:
            self.engine.engine.validate_request(rid, prompt_ids, params, priority, deadline, tenant.weight)
            self.engine.check_capacity(n_prompt)
        except EngineOverloaded as exc:
            raise Overloaded(f"the engine is overloaded ({exc}); retry later", retry_after=exc.retry_after) from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        try:
            lease = self.quotas.reserve(tenant, n_prompt + max_tokens)
        except QuotaExceeded as exc:
            raise RateLimited(str(exc), reason=exc.reason, retry_after=exc.retry_after, headers=exc.headers) from None
        return Admission(rid, tenant, req, prompt_ids, params, priority, deadline, lease, transport, arrival,
                         self.model_name)

    def _tokenize(self, req: ChatRequest) -> list[int]:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:        # a template that refuses the conversation (e.g. role order)
            raise BadRequest(f"messages: the model's chat template rejected them: {exc}", param="messages") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _deadline(self, tenant: Tenant, req: ChatRequest, timeout_header: str | None,
                  arrival: float) -> float | None:
        wanted_ms: float | None = req.deadline_ms
        if timeout_header is not None:
            try:
                seconds = float(timeout_header)
            except ValueError:
                seconds = math.nan
            if not 0 < seconds <= MAX_DEADLINE_MS / 1000:
                raise BadRequest(f"X-Request-Timeout: must be a number of seconds in (0, 86400] "
                                 f"(got {timeout_header!r})", param="X-Request-Timeout")
            wanted_ms = seconds * 1000 if wanted_ms is None else min(wanted_ms, seconds * 1000)
        bound = tenant.limits.deadline_ms
        if bound is not None:
            wanted_ms = bound if wanted_ms is None else min(wanted_ms, bound)
        return None if wanted_ms is None else arrival + wanted_ms / 1000

    # -- generation --------------------------------------------------------------------------
    async def run(self, adm: Admission) -> AsyncIterator[Delta | Done | Failed]:
        """Stream one admitted request. Ends with exactly one Done or Failed unless the
        consumer leaves first; the lease is settled exactly once either way."""
        usage = Usage(len(adm.prompt_ids), 0)
        first = last = queued = None
        status, outcome = CLIENT_CLOSED, "disconnect"
        self.active[adm.request_id] = adm
        self.metrics.stream_opened(adm.transport)
        try:
            finish, error = "abort", None
            if not adm.cancelled:
                stream = self.engine.generate(adm.request_id, adm.prompt_ids, adm.params, priority=adm.priority,
                                              tenant=adm.tenant.name, deadline=adm.deadline, weight=adm.tenant.weight)
                try:
                    async with contextlib.aclosing(stream):
                        async for out in stream:
                            if out.new_token_ids:
                                now = self.clock()
                                if first is None:
                                    first = now
                                else:
                                    self.itl.add(now - last)
                                last = now
                                usage.completion_tokens += len(out.new_token_ids)
                            if out.queue_time_s is not None:
                                queued = out.queue_time_s
                            if out.new_text:
                                yield Delta(out.new_text, len(out.new_token_ids))
                            if out.finished:
                                finish, error = out.finish_reason, out.error
                except EngineOverloaded as exc:
                    finish, error = "overloaded", exc
                except ValueError as exc:
                    finish, error = "invalid", exc
                except RuntimeError as exc:                 # the engine thread is gone
                    finish, error = "error", exc
            terminal = self._terminal(adm, finish, error, usage, first, queued)
            status = terminal.error.status if isinstance(terminal, Failed) else (
                CLIENT_CLOSED if finish == "abort" else 200)
            outcome = terminal.error.code if isinstance(terminal, Failed) else finish
            yield terminal
        finally:
            billed = usage.total_tokens if usage.completion_tokens else 0
            adm.lease.settle(billed)
            self.active.pop(adm.request_id, None)
            self._shutdown_ids.discard(adm.request_id)
            self.metrics.stream_closed(adm.transport)
            self.metrics.request_done(adm.tenant.name, adm.transport, status)
            end = self.clock()
            if first is not None:
                self.metrics.observe_ttft(first - adm.arrival)
            log.info("chat.finished", completion_id=adm.request_id, tenant=adm.tenant.name, transport=adm.transport,
                     status=status, outcome=outcome, prompt_tokens=usage.prompt_tokens,
                     completion_tokens=usage.completion_tokens, billed_tokens=billed,
                     ttft_ms=None if first is None else round((first - adm.arrival) * 1000, 1),
                     duration_ms=round((end - adm.arrival) * 1000, 1))

    def _terminal(self, adm: Admission, finish: str, error, usage: Usage, first: float | None,
                  queued: float | None):
        now = self.clock()
        timings = {"queue_ms": None if queued is None else round(queued * 1000, 2),
                   "ttft_ms": None if first is None else round((first - adm.arrival) * 1000, 2),
                   "total_ms": round((now - adm.arrival) * 1000, 2)}
        if first is not None and usage.completion_tokens > 1 and now > first:
            timings["tokens_per_s"] = round((usage.completion_tokens - 1) / (now - first), 2)
        before = usage.completion_tokens == 0

        def failed(err: GatewayError) -> Failed:
            return Failed(err, usage, timings, before)

        if finish == "deadline":
            n = usage.completion_tokens
            when = "before the first token" if before else f"after {n} token{'s' if n > 1 else ''}"
            return failed(DeadlineExceeded(f"the request's deadline passed {when}"))
        if finish == "abort" and adm.request_id in self._shutdown_ids:
            return failed(Draining(f"the server shut down; the request was stopped after "
                                   f"{usage.completion_tokens} tokens"))
        if finish == "overloaded":
            return failed(Overloaded(f"the engine is overloaded ({error}); retry later",
                                     retry_after=error.retry_after))
        if finish == "invalid":
            return failed(BadRequest(str(error)))
        if finish == "error":
            return failed(InternalError(f"the engine failed this request: {error}"))
        return Done(finish, usage, timings)

    def release(self, adm: Admission) -> None:
        """For an admission whose stream never started (its consumer vanished first):
        return the lease unbilled. A no-op when `run()` already settled it."""
        if adm.lease.settle(0):
            self.metrics.request_done(adm.tenant.name, adm.transport, CLIENT_CLOSED)
            log.info("chat.finished", completion_id=adm.request_id, tenant=adm.tenant.name,
                     transport=adm.transport, status=CLIENT_CLOSED, outcome="never_started",
                     prompt_tokens=len(adm.prompt_ids), completion_tokens=0, billed_tokens=0)

    async def cancel(self, adm: Admission) -> None:
        """Stop a request on the client's behalf; its stream ends with finish_reason 'abort'."""
        adm.cancelled = True
        await self.engine.abort(adm.request_id)

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, let running ones finish for up to `grace_s`, then stop the
        rest; each of those ends with a `server_draining` error event."""
        self.draining = True
        end = self.clock() + grace_s
        while self.active and self.clock() < end:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("drain.aborting", requests=len(self.active))
            for rid in list(self.active):
                self._shutdown_ids.add(rid)
                await self.engine.abort(rid)
            end = self.clock() + 5.0
            while self.active and self.clock() < end:
                await asyncio.sleep(0.05)
