"""AsyncEngine: the engine on one background thread (engine_thread.py), streams on the
event loop. It implements the engine's port, `engine.port.EngineClient`.

On the event loop, a request is checked only against what it may know without the
engine thread: the `EngineLimits` published once at start, the latest `Load` the engine
thread published with its last step, and the adds this side has sent since (each counter
has one writer). The engine thread's `add_request` is the check that decides: a request
that passed here but no longer fits is refused there, and `generate` raises the refusal
before yielding anything. Every request has a one-slot collector that merges outputs
when its consumer falls behind, so the engine never waits on a consumer and a slow
consumer simply gets bigger deltas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry

from .config import EngineConfig, SamplingParams
from .engine_thread import EngineThread, Load
from .grammar import Grammar
from .metrics import _StatsCollector
from .port import EngineClient, EngineLimits, check_capacity, check_request
from .sequence import RequestOutput
from .stats import EngineStats
from .stream import Collector

_STOPPED = "engine stopped"


def _build_engine(config: EngineConfig):
    from .llm_engine import LLMEngine      # imports torch: keep it off the event loop too
    from .threads import release_openmp_pool

    if config.elastic_threads is None:     # served: the event loop and clients share the cores (elastic.py)
        config = dataclasses.replace(config, elastic_threads=True)
    engine = LLMEngine(config)
    if config.openmp_one_team:
        release_openmp_pool()              # the engine thread's OpenMP team is then the only one
    return engine


class AsyncEngine(EngineClient):
    def __init__(self, config: EngineConfig, engine=None):
        self.config = config
        self.engine = engine             # an LLMEngine, built on start() unless given
        self.metrics_registry = CollectorRegistry(auto_describe=True)
        self._thread: EngineThread | None = None
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self._limits: EngineLimits | None = None
        self._collectors: dict[str, Collector] = {}
        self._load = Load()
        self._stats = EngineStats()                                   # the last snapshot built
        self._stats_waiters: list[tuple[int, asyncio.Future]] = []
        self._adds_sent = self._tokens_sent = 0                       # written here only

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the model on a worker thread of its own (so the loop stays responsive), then
        start stepping. The load does not use the loop's default executor, which
        `asyncio.run` joins at exit: a server stopped during the load stops serving at once."""
        loop = asyncio.get_running_loop()
        if self.engine is None:
            # The loading thread stays alive with the engine: measured on this CPU, steps ran
            # ~15x slower (torch ops in the sampler) once the thread that loaded the model exited.
            self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="streamgate-load")
            self.engine = await loop.run_in_executor(self._loader, _build_engine, self.config)
        self._limits = self.engine.limits
        self._stats = self.engine.snapshot()                          # the thread is not running yet
        m = self.engine.metrics
        for collector in (m.queue_time, m.ttft, m.itl, m.tpot, m.e2e, _StatsCollector(lambda: self._stats)):
            self.metrics_registry.register(collector)
        self._thread = EngineThread(self.engine, loop, self)
        self._thread.start()

    async def stop(self) -> None:
        """Abort everything still running and stop the engine thread."""
        if self._thread is not None:              # kept: `error` still says what ended it
            await asyncio.to_thread(self._thread.join)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)       # tensor-parallel ranks: bounded
        if self._loader is not None:
            self._loader.shutdown(wait=False)
        self.on_exit({}, None)                 # requests the thread never took (its own ended already)

    @property
    def ready(self) -> bool:
        """Started, stepping and not failed."""
        return self._thread is not None and self._thread.running and self.error is None

    @property
    def error(self) -> BaseException | None:
        """What ended the engine thread, or None."""
        return None if self._thread is None else self._thread.error

    @property
    def limits(self) -> EngineLimits:
        if self._limits is None:
            raise RuntimeError("AsyncEngine has not started (call start())")
        return self._limits

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    async def stats(self) -> EngineStats:
        """A snapshot the engine thread builds for this call, after its current step (at
        once when idle); calls waiting together share one. Requests still on their way to
        the engine thread count as waiting. After stop: the last one built."""
        if self._thread is not None and self._thread.running:
            waiter = asyncio.get_running_loop().create_future()
            self._stats_waiters.append((self._thread.ask_stats(), waiter))
            await waiter
        pending = self._pending_adds
        return dataclasses.replace(self._stats, waiting=self._stats.waiting + pending, pending_adds=pending)

    @property
    def _pending_adds(self) -> int:
        return self._adds_sent - self._load.adds_taken

    # -- requests ---------------------------------------------------------------------------
    def validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 priority: int = 0, deadline: float | None = None, weight: float = 1.0) -> None:
        """Raise ValueError (bad input, naming the field) or EngineOverloaded (a queue
        limit) for a request that `generate` would refuse; changes nothing."""
        check_request(self.limits, request_id, prompt_token_ids, params, priority, deadline, weight)
        self._check_admissible(request_id, len(prompt_token_ids))

    def _check_admissible(self, request_id: str, num_tokens: int) -> None:
        if request_id in self._collectors:
            raise ValueError(f"request_id {request_id!r} is already in use")
        load = self._load
        check_capacity(self.limits, load.waiting + self._pending_adds,
                       load.queued_tokens + self._tokens_sent - load.tokens_taken, num_tokens)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       priority: int = 0, tenant: str | None = None, deadline: float | None = None,
                       weight: float = 1.0, validated: bool = False,
                       on_final: Callable[[RequestOutput], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Bad input raises ValueError and a full queue raises
        EngineOverloaded, both before anything is yielded (`validated=True`: the caller ran
        `validate` already, and only the engine thread checks again). Leaving the iterator
        early (break, cancellation, disconnect) aborts the request.

        `on_final(output)` is called on the event loop exactly once for a queued request,
        with its final output (which carries the engine's token counts), even if the
        consumer left before it arrived."""
        if not self.ready:
            raise RuntimeError("AsyncEngine is not running (call start())")
        if not validated:
            if isinstance(getattr(params, "grammar", None), Grammar):   # ~100 ms for 64 KiB: off the loop
                await asyncio.to_thread(params.grammar.check)
            self.validate(request_id, prompt_token_ids, params, priority=priority, deadline=deadline, weight=weight)
        elif request_id in self._collectors:
            raise ValueError(f"request_id {request_id!r} is already in use")
        collector = self._collectors[request_id] = Collector(on_final)
        self._adds_sent += 1
        self._tokens_sent += len(prompt_token_ids)
        self._thread.send(("add", request_id, list(prompt_token_ids), params,
                           dict(priority=priority, tenant=tenant, deadline=deadline, weight=weight)))
        finished = False
        try:
            while not finished:
                out = await collector.get()          # raises the engine thread's refusal
                finished = out.finished
                yield out
        finally:
            if finished or collector.refused or (collector.output is not None and collector.output.finished):
                # (the last case: cancelled in the same loop pass as the final output landed)
                self._collectors.pop(request_id, None)
            else:
                # The id stays taken until the engine's final output for it arrives, so a
                # reused id can never receive this request's abort.
                collector.detached = True
                self._thread.send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed by the next step. Unknown ids are ignored."""
        if self.ready:
            self._thread.send(("abort", request_id))

    # -- what the engine thread hands back (engine_thread.Sink), on the loop -----------------
    def on_step(self, outputs: list[RequestOutput], load: Load, stats: EngineStats | None, ticket: int) -> None:
        self._load = load
        if stats is not None:
            self._stats = stats
            due = [w for t, w in self._stats_waiters if t <= ticket]
            self._stats_waiters = [(t, w) for t, w in self._stats_waiters if t > ticket]
            for waiter in due:
                if not waiter.done():
                    waiter.set_result(None)
        self._dispatch(outputs)

    def on_refused(self, request_id: str, exc: Exception) -> None:
        collector = self._collectors.get(request_id)
        if collector is not None:
            if collector.detached:                   # its consumer left: nobody to tell
                del self._collectors[request_id]
            else:
                collector.refuse(exc)

    def on_exit(self, computed: dict[str, int], error: str | None) -> None:
        """The engine thread ended: end every request (stopped: 'abort'; crashed: 'error')."""
        for waiter in [w for _, w in self._stats_waiters]:
            if not waiter.done():
                waiter.set_result(None)
        self._stats_waiters = []
        reason = "abort" if error is None else "error"
        self._dispatch([RequestOutput(rid, [], "", True, reason, error=error or _STOPPED,
                                      num_computed_prompt_tokens=computed.get(rid, 0))
                        for rid in list(self._collectors)])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is None:
                continue
            collector.deliver(out)
            if collector.detached and out.finished:
                del self._collectors[out.request_id]
