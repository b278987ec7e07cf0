"""The engine's own thread: it alone touches the `LLMEngine` (its sequences, scheduler and
block manager) once `AsyncEngine.start()` has returned.

It loops: drain the command queue (`add_request`, the one check that decides, and
`abort`), `step()`, then publish. Publishing is one `loop.call_soon_threadsafe` per step
that hands the event loop the step's outputs, a `Load` (the queue numbers the loop's
pre-check needs, with how many adds they include) and, only when the loop asked for one,
an `EngineStats` snapshot. A request `add_request` refuses comes back as a refusal, not an
output; when the thread ends (stop or crash) it hands back the prompt tokens each of its
requests had computed, so the loop can end them and bill them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Protocol

from .errors import EngineOverloaded
from .sequence import RequestOutput
from .stats import EngineStats

log = logging.getLogger("streamgate.engine")


@dataclass(frozen=True)
class Load:
    """The engine thread's queue after a step, and how many adds it had taken by then."""

    waiting: int = 0            # requests queued (not yet scheduled)
    queued_tokens: int = 0      # their tokens
    adds_taken: int = 0         # adds taken from the command queue so far (accepted or refused)
    tokens_taken: int = 0       # their prompt tokens


class Sink(Protocol):
    """Where the engine thread's results land, each called on the event loop."""

    def on_step(self, outputs: list[RequestOutput], load: Load, stats: EngineStats | None, ticket: int) -> None: ...

    def on_refused(self, request_id: str, exc: Exception) -> None: ...

    def on_exit(self, computed: dict[str, int], error: str | None) -> None: ...


class EngineThread:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop, sink: Sink):
        self.engine = engine
        self.loop = loop
        self.sink = sink
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.running = False
        self.error: BaseException | None = None
        self.stats_asked = 0            # written by the loop only: stats tickets handed out
        self._stats_built = 0           # the last ticket a snapshot was built for
        self._adds_taken = self._tokens_taken = 0
        self._thread: threading.Thread | None = None

    # -- the event loop's side --------------------------------------------------------------
    def start(self) -> None:
        self.running = True
        self._thread = threading.Thread(target=self._run, name="streamgate-engine", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Stop stepping and wait for the thread (it ends its requests on the way out)."""
        self.running = False
        self.wake.set()
        if self._thread is not None:
            self._thread.join()

    def send(self, command: tuple) -> None:
        self.commands.put(command)
        self.wake.set()

    def ask_stats(self) -> int:
        """Ask for a snapshot after the current step (at once when idle); returns its ticket."""
        self.stats_asked += 1
        self.wake.set()
        return self.stats_asked

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while self.running:
                engine.check_health()                # a failed tensor-parallel rank ends the engine
                changed = self._drain()
                if engine.has_unfinished():
                    self._publish(engine.step())
                elif changed or self.stats_asked != self._stats_built:
                    self._publish([])
                else:
                    self.wake.wait(timeout=0.5)
                    self.wake.clear()
        except BaseException as exc:                # a bug outside the per-batch guard
            log.exception("engine thread crashed")
            self.error = exc
            self.running = False
            self._exit(f"{type(exc).__name__}: {exc}")
            return
        self._exit(None)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        sched = self.engine.scheduler
        load = Load(len(sched.waiting), sched.queued_tokens(), self._adds_taken, self._tokens_taken)
        ticket, stats = self.stats_asked, None
        if ticket != self._stats_built:
            stats, self._stats_built = self.engine.snapshot(), ticket
        self.loop.call_soon_threadsafe(self.sink.on_step, outputs, load, stats, ticket)

    def _drain(self) -> bool:
        """Apply queued adds and aborts; True if there were any."""
        changed = False
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if command[0] == "add":
                _, rid, prompt, params, kwargs = command
                try:
                    self.engine.add_request(rid, prompt, params, checked=True, **kwargs)
                except (ValueError, EngineOverloaded) as exc:   # the queue filled since the pre-check
                    self.loop.call_soon_threadsafe(self.sink.on_refused, rid, exc)
                finally:        # after the add: a pre-check in between counts it twice, never zero times
                    self._adds_taken += 1
                    self._tokens_taken += len(prompt)
            else:
                self.engine.abort(command[1])

    def _exit(self, error: str | None) -> None:
        """Hand the loop every live request's computed prompt tokens; it ends them."""
        try:
            computed = {rid: seq.num_computed_prompt_tokens for rid, seq in self.engine.seqs.items()}
        except Exception:                           # state a crash left half-updated
            computed = {}
        try:
            self.loop.call_soon_threadsafe(self.sink.on_exit, computed, error)
        except RuntimeError:                        # the loop is closed: nobody is waiting
            pass
