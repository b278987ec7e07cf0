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

import structlog

from engine import EngineClient
from tenants import QuotaManager, Tenant

from .admission import Admission, Admitter
from .fanout import choices, engine_ids
from .errors import Draining, GatewayError, Overloaded, RateLimited, Unavailable
from .live import ItlWindow
from .stream_events import Delta, Done, Failed, StreamAccumulator, Usage, refusal, streamed

__all__ = ["ChatService", "CLIENT_CLOSED", "Delta", "Done", "Failed", "Usage", "streamed"]

log = structlog.get_logger("streamgate.gateway")

CLIENT_CLOSED = 499     # nginx's "client closed request", for metrics and logs


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
        acc = StreamAccumulator(adm.request.n, len(adm.prompt_ids), self.clock, self.itl)
        refused: GatewayError | None = None
        queued, status, outcome = False, CLIENT_CLOSED, "disconnect"
        self.active[adm.request_id] = adm
        self.metrics.stream_opened(adm.transport)
        try:
            if not adm.cancelled:
                stream = choices(self.engine, adm, lambda billed: self._settle(adm, max(billed, streamed(acc.usage))))
                try:
                    async with contextlib.aclosing(stream):
                        queued = True       # the first step of the iteration queues it, or raises
                        async for index, out in stream:
                            if out.prompt_logprobs is not None:     # the first output's (echo)
                                adm.prompt_logprobs = out.prompt_logprobs
                            if (delta := acc.add(index, out)) is not None:
                                yield delta
                except (ValueError, RuntimeError) as exc:      # refused before it was queued, or no engine
                    queued, refused = False, refusal(exc)
            terminal = self._terminal(adm, acc, refused)
            status = terminal.error.status if isinstance(terminal, Failed) else (
                CLIENT_CLOSED if terminal.finish_reason == "abort" else 200)
            outcome = terminal.error.code if isinstance(terminal, Failed) else terminal.finish_reason
            yield terminal
        finally:
            if not queued:
                self._settle(adm, 0)
            self._closed(adm, status, outcome, acc)

    def _closed(self, adm: Admission, status: int, outcome: str, acc: StreamAccumulator) -> None:
        self.active.pop(adm.request_id, None)
        self._shutdown_ids.discard(adm.request_id)
        self.metrics.stream_closed(adm.transport)
        self.metrics.request_done(adm.tenant.name, adm.transport, status)
        ttft = None if acc.first is None else acc.first - adm.arrival
        if ttft is not None:
            self.metrics.observe_ttft(ttft)
        log.info("chat.finished", completion_id=adm.request_id, tenant=adm.tenant.name, transport=adm.transport,
                 status=status, outcome=outcome, prompt_tokens=acc.usage.prompt_tokens,
                 completion_tokens=acc.usage.completion_tokens, billed_tokens=adm.billed,
                 ttft_ms=None if ttft is None else round(ttft * 1000, 1),
                 duration_ms=round((self.clock() - adm.arrival) * 1000, 1))

    def _settle(self, adm: Admission, billed: int) -> None:
        if adm.lease.settle(billed):
            adm.billed = billed
            if adm.request_id not in self.active:     # chat.finished is written: say it now
                log.info("chat.billed", completion_id=adm.request_id, tenant=adm.tenant.name, billed_tokens=billed)

    def _terminal(self, adm: Admission, acc: StreamAccumulator, refused: GatewayError | None) -> Done | Failed:
        timings = acc.timings(adm.arrival)
        error = refused
        if error is None and acc.finish == "abort" and adm.request_id in self._shutdown_ids:
            error = Draining(f"the server shut down; the request was stopped after "
                             f"{acc.usage.completion_tokens} tokens")
        if error is None:
            error = acc.failure("tools" if getattr(adm.request, "forced_tool", None) else "response_format")
        if error is not None:
            return Failed(error, acc.usage, timings, acc.usage.completion_tokens == 0)
        return Done(acc.finish, acc.usage, timings, acc.finishes)

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
