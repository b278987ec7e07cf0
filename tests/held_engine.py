"""The real engine that steps only on permits, so a stream outlasts a wait by an event,
never by a model slow enough (a test's verdict must not depend on the host's speed).

`HeldEngine(config, steps=N)` is an `AsyncEngine` over a real `LLMEngine` whose `step()`
runs freely N times (None: without limit), then holds: requests stay running (blocks,
slot and lease taken) without producing tokens until the test calls `allow(n)` (n more
steps) or `release()` (no limit again); `hold(n)` limits it to n steps from now. While
held the engine thread still does everything but decode:

- adds and aborts are drained at once (the held step returns to the thread's loop);
- an abort's final output goes out at once (one real step delivers it, which may give
  the other running requests one token each);
- a stats request gets its snapshot at once;
- a running or waiting request whose deadline the engine's clock has passed gets the one
  step that lets the scheduler end it (so deadline tests wait on the engine's clock);
- stop ends the thread;
- a failed tensor-parallel rank ends the engine (its health is checked as between steps).

Test-only: it reads two engine internals (the engine thread's command queue and wake
event, and `LLMEngine._pending`), which is why it lives here and not in engine/.
"""

from __future__ import annotations

import threading

from engine import AsyncEngine, EngineConfig
from engine.llm_engine import LLMEngine


class StepGate:
    """An `LLMEngine` whose `step()` waits for a permit (everything else passes through)."""

    def __init__(self, engine: LLMEngine, steps: int | None, hold_when=None):
        self._engine = engine
        self._lock = threading.Lock()
        self._permits = steps          # None: no limit
        self._hold_when = hold_when    # engine -> bool: held whatever the permits (see long_held)
        self.thread = None             # the EngineThread, set once it exists
        self.steps = 0                 # real steps taken

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def allow(self, n: int | None) -> None:
        with self._lock:
            self._permits = None if n is None or self._permits is None else self._permits + n
        if self.thread is not None:
            self.thread.wake.set()

    def hold(self, n: int) -> None:
        with self._lock:
            self._permits = n
        if self.thread is not None:
            self.thread.wake.set()

    def _take_permit(self) -> bool:
        if self._hold_when is not None and self._hold_when(self._engine):
            return False
        with self._lock:
            if self._permits is None:
                return True
            if self._permits > 0:
                self._permits -= 1
                return True
            return False

    def _deadline_due(self) -> bool:
        now = self._engine.clock()
        return any(s.deadline is not None and s.deadline <= now for s in list(self._engine.seqs.values()))

    def step(self):
        t = self.thread
        while not self._take_permit():
            if self._engine._pending or self._deadline_due():
                break                   # an abort's final output, or a deadline to enforce
            if t is None:
                return []
            t.wake.clear()              # cleared before the checks: a setter sets state first
            self._engine.check_health()  # a tensor-parallel rank that died ends the engine, as between steps
            if not t.running or not t.commands.empty() or t.stats_asked != t._stats_built:
                return []               # let the thread drain, publish a snapshot or stop
            if not self._take_permit():
                t.wake.wait(0.05)       # woken by an add, abort, stats request, allow or stop
                continue
            break
        self.steps += 1
        return self._engine.step()


def long_held(min_max_tokens: int = 1000, after: int = 16):
    """A `hold_when` for a whole server's life: held while every unfinished request that
    asked for at least `min_max_tokens` has produced `after` tokens (and there is one), so
    such a stream runs until it is aborted (a disconnect, a drain, a kill) and short
    requests beside it wait. Used by tests.held_serve for real `streamgate serve` processes."""

    def hold(engine: LLMEngine) -> bool:
        long = [s for s in list(engine.seqs.values())
                if not s.status.finished and s.params.max_tokens >= min_max_tokens]
        return bool(long) and all(len(s.output_token_ids) >= after for s in long)
    return hold


class HeldEngine(AsyncEngine):
    """The real engine: `steps` free steps (None: all), then held until `allow`/`release`;
    with `hold_when`, also held whenever it says so."""

    def __init__(self, config: EngineConfig, steps: int | None = 0, hold_when=None):
        self.gate = StepGate(LLMEngine(config), steps, hold_when)
        super().__init__(config, engine=self.gate)

    async def start(self) -> None:
        await super().start()
        self.gate.thread = self._thread
        self._thread.wake.set()

    async def stop(self) -> None:
        self.gate.allow(None)
        await super().stop()

    def allow(self, n: int) -> None:
        """n more steps (thread-safe: call it from the test's thread)."""
        self.gate.allow(n)

    def hold(self, steps: int = 0) -> None:
        """`steps` more steps, then held (thread-safe)."""
        self.gate.hold(steps)

    def release(self) -> None:
        """Step freely from now on."""
        self.gate.allow(None)
