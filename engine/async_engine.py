"""AsyncEngine: the engine on one background thread, streams on the event loop.

The engine thread runs `LLMEngine.step()` in a loop. Requests and aborts reach it through
a thread-safe command queue that it drains before each step; each step's outputs come
back to the event loop in one `call_soon_threadsafe`, together with an immutable stats
snapshot the engine thread took right after the step (as vLLM ships `scheduler_stats`
with its outputs): the event loop never reads the scheduler's lists. Every request has a
one-slot collector that merges outputs when its consumer falls behind, so the engine
never waits on a consumer and a slow consumer simply gets bigger deltas.

The public surface the gateway uses: `start`/`stop`, `ready`, `error`, `max_model_len`,
`tokenizer`, `validate`, `generate`, `abort`, `stats()` (the latest snapshot) and
`metrics_registry` (Prometheus, read from the snapshot at scrape time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from types import MappingProxyType

from prometheus_client import CollectorRegistry

from .config import EngineConfig, SamplingParams
from .errors import EngineOverloaded
from .grammar import Grammar
from .metrics import _StatsCollector
from .sequence import RequestOutput

log = logging.getLogger("streamgate.engine")


class _Collector:
    """One request's mailbox: holds at most one (merged) output."""

    __slots__ = ("output", "event", "detached", "on_final")

    def __init__(self, on_final: Callable[[RequestOutput], None] | None) -> None:
        self.output: RequestOutput | None = None
        self.event = asyncio.Event()
        self.detached = False    # the consumer left; kept until the engine confirms the end
        self.on_final = on_final

    def put(self, out: RequestOutput) -> None:
        self.output = out if self.output is None else self.output.merge(out)
        self.event.set()

    async def get(self) -> RequestOutput:
        await self.event.wait()
        self.event.clear()
        out, self.output = self.output, None
        return out


def _build_engine(config: EngineConfig):
    from .llm_engine import LLMEngine      # imports torch: keep it off the event loop too

    return LLMEngine(config)


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine=None):
        self.config = config
        self.engine = engine             # an LLMEngine, built on start() unless given
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._collectors: dict[str, _Collector] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self._snapshot: MappingProxyType = MappingProxyType({})
        self._computed: dict[str, int] = {}   # engine thread only: most prompt tokens computed, per request
        self.metrics_registry = CollectorRegistry(auto_describe=True)
        self.error: BaseException | None = None
        # Adds sent but not yet queued by the engine thread: each counter has one writer.
        self._adds_sent = self._adds_taken = 0            # requests (loop / engine thread)
        self._tokens_sent = self._tokens_taken = 0        # their prompt tokens

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the model on a worker thread of its own (so the loop stays responsive), then
        start stepping. The load does not use the loop's default executor, which
        `asyncio.run` joins at exit: a server stopped during the load stops serving at once."""
        self._loop = asyncio.get_running_loop()
        if self.engine is None:
            # The loading thread stays alive with the engine: measured on this CPU, steps ran
            # ~15x slower (torch ops in the sampler) once the thread that loaded the model exited.
            self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="streamgate-load")
            self.engine = await self._loop.run_in_executor(self._loader, _build_engine, self.config)
        self._snapshot = MappingProxyType(self.engine.stats())       # the thread is not running yet
        m = self.engine.metrics
        for collector in (m.queue_time, m.ttft, m.itl, m.tpot, m.e2e, _StatsCollector(self.stats)):
            self.metrics_registry.register(collector)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="streamgate-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort everything still running and stop the engine thread."""
        self._running = False
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)       # tensor-parallel ranks: bounded
        if self._loader is not None:
            self._loader.shutdown(wait=False)
        self._dispatch([RequestOutput(rid, [], "", True, "abort", error="engine stopped",
                                      num_computed_prompt_tokens=self._computed.get(rid, 0))
                        for rid in list(self._collectors)], None)

    @property
    def ready(self) -> bool:
        """Started, stepping and not failed."""
        return self._running and self.error is None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> dict:
        """The engine thread's latest snapshot (`LLMEngine.stats()` taken after a step),
        with requests still in the command queue counted as waiting."""
        stats = dict(self._snapshot)
        if stats:
            stats["waiting"] += self._pending_adds
            stats["pending_adds"] = self._pending_adds
        return stats

    @property
    def _pending_adds(self) -> int:
        return max(0, self._adds_sent - self._adds_taken)

    # -- requests ---------------------------------------------------------------------------
    def validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 priority: int = 0, deadline: float | None = None, weight: float = 1.0) -> None:
        """Raise ValueError (bad input, naming the field) or EngineOverloaded (a queue
        limit) for a request that `generate` would refuse; changes nothing."""
        self.engine.validate_request(request_id, prompt_token_ids, params, priority, deadline, weight)
        self._check_admissible(request_id, len(prompt_token_ids))

    def _check_admissible(self, request_id: str, num_tokens: int) -> None:
        if request_id in self._collectors:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_capacity(num_tokens)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       priority: int = 0, tenant: str | None = None, deadline: float | None = None,
                       weight: float = 1.0, validated: bool = False,
                       on_final: Callable[[RequestOutput], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Bad input raises ValueError and a full queue raises
        EngineOverloaded, both before anything is queued (`validated=True`: the caller ran
        `validate` already; only the queue limits are checked again). Leaving the iterator
        early (break, cancellation, disconnect) aborts the request.

        `on_final(output)` is called on the event loop exactly once for a queued request,
        with its final output (which carries the engine's token counts), even if the
        consumer left before it arrived."""
        if not self._running:
            raise RuntimeError("AsyncEngine is not running (call start())")
        if not validated:
            if isinstance(getattr(params, "grammar", None), Grammar):   # ~100 ms for 64 KiB: off the loop
                await asyncio.to_thread(params.grammar.check)
            self.engine.validate_request(request_id, prompt_token_ids, params, priority, deadline, weight)
        self._check_admissible(request_id, len(prompt_token_ids))
        collector = self._collectors[request_id] = _Collector(on_final)
        self._adds_sent += 1
        self._tokens_sent += len(prompt_token_ids)
        self._send(("add", request_id, list(prompt_token_ids), params,
                    dict(priority=priority, tenant=tenant, deadline=deadline, weight=weight)))
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if finished or (collector.output is not None and collector.output.finished):
                # (the second case: cancelled in the same loop pass as the final output landed)
                self._collectors.pop(request_id, None)
            else:
                # The id stays taken until the engine's final output for it arrives, so a
                # reused id can never receive this request's abort.
                collector.detached = True
                self._send(("abort", request_id))

    def check_capacity(self, num_tokens: int) -> None:
        """Raise EngineOverloaded if a request of `num_tokens` would pass a queue limit,
        counting requests still on their way to the engine thread."""
        self.engine.scheduler.check_capacity(num_tokens, count=False,
                                             pending_requests=self._pending_adds,
                                             pending_tokens=max(0, self._tokens_sent - self._tokens_taken))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed by the next step. Unknown ids are ignored."""
        if self._running:
            self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while self._running:
            try:
                engine.check_health()                # a failed tensor-parallel rank ends the engine
                changed = self._drain_commands()
                if not engine.has_unfinished():
                    if changed:
                        self._publish([])
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                self._publish(outputs)
            except BaseException as exc:            # a bug outside the per-batch guard
                log.exception("engine thread crashed")
                self.error = exc
                self._running = False
                self._loop.call_soon_threadsafe(self._fail_all, f"{type(exc).__name__}: {exc}")
                return

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs and a fresh stats snapshot to the event loop (engine thread).

        A request's final output is stamped with the most prompt tokens the engine ever
        held computed for it: freeing its blocks (abort, deadline, preemption) zeroes the
        sequence's own count, and billing needs the work that was done."""
        for rid, seq in self.engine.seqs.items():
            done = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            if done > self._computed.get(rid, 0):
                self._computed[rid] = done
        for out in outputs:
            if out.finished:
                out.num_computed_prompt_tokens = max(out.num_computed_prompt_tokens,
                                                     self._computed.pop(out.request_id, 0))
        self._loop.call_soon_threadsafe(self._dispatch, outputs, MappingProxyType(self.engine.stats()))

    def _drain_commands(self) -> bool:
        """Apply queued adds and aborts; True if there were any."""
        changed = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if command[0] == "add":
                _, rid, prompt, params, kwargs = command
                try:
                    self.engine.add_request(rid, prompt, params, **kwargs)
                except (ValueError, EngineOverloaded) as exc:   # should not happen: pre-checked
                    self._loop.call_soon_threadsafe(
                        self._dispatch, [RequestOutput(rid, [], "", True, "error", error=str(exc))], None)
                finally:        # after the add: a pre-check in between counts it twice, never zero times
                    self._adds_taken += 1
                    self._tokens_taken += len(prompt)
            else:
                self.engine.abort(command[1])

    def _dispatch(self, outputs: list[RequestOutput], snapshot: MappingProxyType | None) -> None:
        if snapshot is not None:
            self._snapshot = snapshot
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is None:
                continue
            if out.finished and collector.on_final is not None:
                on_final, collector.on_final = collector.on_final, None
                try:
                    on_final(out)
                except Exception:
                    log.exception("on_final callback failed for %s", out.request_id)
            if collector.detached:
                if out.finished:
                    del self._collectors[out.request_id]
            else:
                collector.put(out)

    def _fail_all(self, message: str) -> None:
        self._dispatch([RequestOutput(rid, [], "", True, "error", error=message,
                                      num_computed_prompt_tokens=self._computed.get(rid, 0))
                        for rid in list(self._collectors)], None)
