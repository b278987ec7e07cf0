"""The chat pipeline, transport-free: `ChatService.admit()` (gateway/admission.py), then
`run()`, an async generator of `Delta` events ending with exactly one `Done` or `Failed`.

However a request ends — finish, cancel, disconnect (the consumer closes or cancels
`run()`), deadline, shutdown, error — its lease is settled exactly once: from the
engine's final output once the request was queued (so a request that leaves before its
first token still pays for the prompt the engine computed), with 0 otherwise.
`sse.py` and `ws.py` only translate these events to their wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from engine import EngineClient, EngineOverloaded
from tenants import QuotaManager, Tenant

from .admission import Admission, Admitter
from .fanout import choices, engine_ids
from .errors import (BadRequest, DeadlineExceeded, Draining, GatewayError, InternalError, Overloaded,
                     RateLimited, Unavailable)
from .live import ItlWindow

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
    num_tokens: int     # the deltas' num_tokens add up to usage.completion_tokens
    index: int = 0      # the choice (request `n`)
    logprobs: list | None = None        # engine TokenLogprobs of this delta's tokens (when asked)
    finish_reason: str | None = None    # set on a choice's last delta


@dataclass
class Done:
    finish_reason: str          # stop | length | abort (cancelled by the client)
    usage: Usage
    timings: dict
    finish_reasons: list = field(default_factory=list)      # per choice (request `n`)


@dataclass
class Failed:
    error: GatewayError
    usage: Usage
    timings: dict
    before_first_token: bool


def streamed(usage) -> int:
    """What the gateway itself saw streamed: prompt + completion once a token came. The
    engine's final counts are billed, never less than this (a final output made up when
    the engine stops or fails with requests in flight carries no counts)."""
    return usage.total_tokens if usage.completion_tokens else 0


class ChatService:
    def __init__(self, engine: EngineClient, quotas: QuotaManager, metrics, *, model_name: str,
                 default_max_tokens: int = 1024, clock=time.monotonic, tokenize_workers: int = 2):
        self.engine = engine            # started by the app's lifespan
        self.metrics = metrics
        self.model_name = model_name
        self.clock = clock
        self.admitter = Admitter(engine, quotas, model_name=model_name, default_max_tokens=default_max_tokens,
                                 clock=clock, tokenize_workers=tokenize_workers)
        self.draining = False
        self.ready = False
        self.active: dict[str, Admission] = {}
        self.itl = ItlWindow(clock=clock)
        self._shutdown_ids: set[str] = set()

    def on_engine_started(self) -> None:
        """Call off the event loop: it scans the tokenizer's vocabulary."""
        self.admitter.on_engine_started()

    def close(self) -> None:
        if self.admitter.tokenizers is not None:
            self.admitter.tokenizers.close()

    @property
    def max_model_len(self) -> int:
        return self.admitter.max_model_len

    def precheck(self, tenant: Tenant, transport: str) -> None:
        """Refuse, before any work on the body (reading, decoding, validating), a tenant
        its quota would refuse anyway; raises the GatewayError admit() would."""
        try:
            self.admitter.precheck(tenant)
        except GatewayError as exc:
            self._refused(tenant, transport, exc)
            raise

    def _refused(self, tenant: Tenant, transport: str, exc: GatewayError) -> None:
        self.metrics.request_done(tenant.name, transport, exc.status)
        if isinstance(exc, RateLimited):
            self.metrics.rate_limited(tenant.name, exc.reason)      # counted; not one log line each
            log.debug("chat.refused", tenant=tenant.name, transport=transport, status=exc.status, code=exc.code)
        else:
            log.info("chat.refused", tenant=tenant.name, transport=transport, status=exc.status, code=exc.code)

    async def admit(self, tenant: Tenant, body: object, *, transport: str, timeout_s: float | None = None,
                    request_id: str | None = None, kind: str = "chat") -> Admission:
        """Validate, tokenize, clamp to the tenant's limits and reserve quota. Raises a
        GatewayError (holding nothing) when the request cannot be served."""
        try:
            if self.draining:
                raise Draining("the server is shutting down and accepts no new requests")
            if self.engine.error is not None:
                raise Unavailable(f"the engine failed ({type(self.engine.error).__name__}); "
                                  "the server needs a restart")
            if not self.ready:
                raise Overloaded("the model is still loading", retry_after=5.0)
            return await self.admitter.admit(tenant, body, transport=transport, timeout_s=timeout_s,
                                             request_id=request_id, kind=kind)
        except GatewayError as exc:
            self._refused(tenant, transport, exc)
            raise

    # -- generation --------------------------------------------------------------------------
    async def run(self, adm: Admission) -> AsyncIterator[Delta | Done | Failed]:
        """Stream one admitted request. Ends with exactly one Done or Failed unless the
        consumer leaves first; the lease is settled exactly once either way."""
        usage = Usage(len(adm.prompt_ids), 0)
        first = last = queued_s = None
        status, outcome = CLIENT_CLOSED, "disconnect"
        queued = False
        self.active[adm.request_id] = adm
        self.metrics.stream_opened(adm.transport)
        try:
            finish, error = "abort", None
            finishes = ["abort"] * adm.request.n
            if not adm.cancelled:
                stream = choices(self.engine, adm, lambda billed: self._settle(adm, max(billed, streamed(usage))))
                unsent = [0] * adm.request.n        # tokens of outputs that carried no text yet
                held: list = [None] * adm.request.n     # their logprobs
                try:
                    async with contextlib.aclosing(stream):
                        queued = True       # the first step of the iteration queues it, or raises
                        async for index, out in stream:
                            if out.new_token_ids:
                                now = self.clock()
                                if first is None:
                                    first = now
                                else:
                                    self.itl.add(now - last)
                                last = now
                                usage.completion_tokens += len(out.new_token_ids)
                                unsent[index] += len(out.new_token_ids)
                                if out.logprobs:
                                    held[index] = (held[index] or []) + list(out.logprobs)
                            if out.queue_time_s is not None:
                                queued_s = out.queue_time_s
                            if out.finished:
                                finishes[index] = out.finish_reason
                            if out.new_text or (out.finished and (unsent[index] or adm.request.n > 1)):
                                yield Delta(out.new_text, unsent[index], index, held[index],
                                            out.finish_reason if out.finished and adm.request.n > 1 else None)
                                unsent[index], held[index] = 0, None
                            if out.finished and (finish == "abort" or out.finish_reason not in ("stop", "length")):
                                finish, error = out.finish_reason, out.error
                except EngineOverloaded as exc:
                    queued, finish, error = False, "overloaded", exc
                except ValueError as exc:
                    queued, finish, error = False, "invalid", exc
                except RuntimeError as exc:                 # the engine thread is gone
                    queued, finish, error = False, "error", exc
            terminal = self._terminal(adm, finish, error, usage, first, queued_s)
            if isinstance(terminal, Done):
                terminal.finish_reasons = finishes
            status = terminal.error.status if isinstance(terminal, Failed) else (
                CLIENT_CLOSED if finish == "abort" else 200)
            outcome = terminal.error.code if isinstance(terminal, Failed) else finish
            yield terminal
        finally:
            if not queued:
                self._settle(adm, 0)
            self.active.pop(adm.request_id, None)
            self._shutdown_ids.discard(adm.request_id)
            self.metrics.stream_closed(adm.transport)
            self.metrics.request_done(adm.tenant.name, adm.transport, status)
            if first is not None:
                self.metrics.observe_ttft(first - adm.arrival)
            log.info("chat.finished", completion_id=adm.request_id, tenant=adm.tenant.name, transport=adm.transport,
                     status=status, outcome=outcome, prompt_tokens=usage.prompt_tokens,
                     completion_tokens=usage.completion_tokens, billed_tokens=adm.billed,
                     ttft_ms=None if first is None else round((first - adm.arrival) * 1000, 1),
                     duration_ms=round((self.clock() - adm.arrival) * 1000, 1))

    def _settle(self, adm: Admission, billed: int) -> None:
        if adm.lease.settle(billed):
            adm.billed = billed
            if adm.request_id not in self.active:     # chat.finished is written: say it now
                log.info("chat.billed", completion_id=adm.request_id, tenant=adm.tenant.name, billed_tokens=billed)

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
        if finish == "error" and str(error).startswith("grammar:") and usage.completion_tokens == 0:
            field = "tools" if getattr(adm.request, "forced_tool", None) else "response_format"
            return failed(BadRequest(f"{field}: {error}", param=field))     # the compile failed or ran too long
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
        for rid in engine_ids(adm):
            await self.engine.abort(rid)

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, let running ones finish for up to `grace_s`, then stop the
        rest; each of those ends with a `server_draining` error event."""
        self.draining = True
        end = self.clock() + grace_s
        while self.active and self.clock() < end:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("drain.aborting", requests=len(self.active))
            for rid, adm in list(self.active.items()):
                self._shutdown_ids.add(rid)
                for engine_id in engine_ids(adm):
                    await self.engine.abort(engine_id)
            end = self.clock() + 5.0
            while self.active and self.clock() < end:
                await asyncio.sleep(0.05)
