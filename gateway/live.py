"""The live scheduler view: aggregate numbers only (no tenant's prompts or text), sent to
subscribers of the WebSocket `stats.subscribe` message and to `GET /v1/stats` (SSE).

`StatsHub` makes the cost independent of the number of listeners: one task asks the
engine for one snapshot per tick in which someone is due (the engine builds it only then),
renders it once per interval class and hands the same JSON text to every subscriber that
is due; a subscriber that falls behind just gets the latest one.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from collections import deque

import structlog

from engine import EngineStats

log = structlog.get_logger("streamgate.gateway")

_ENGINE_FIELDS = ("waiting", "running", "swapped", "kv_blocks_used", "kv_blocks_total", "kv_cache_usage",
                  "host_blocks_used", "host_blocks_total", "num_batched_tokens", "num_decode_tokens",
                  "num_prefill_tokens", "num_seqs_scheduled", "num_preemptions", "preemptions_recompute",
                  "preemptions_swap", "deadline_drops", "deadline_finishes", "rejections",
                  "prompt_tokens", "generation_tokens", "prefix_cache_hit_rate", "step_time_s")


class ItlWindow:
    """Inter-token gaps seen by the gateway over the last `span_s` seconds (all streams).
    Used from the event loop only."""

    def __init__(self, span_s: float = 60.0, clock=time.monotonic, maxlen: int = 50_000):
        self.span_s = span_s
        self.clock = clock
        self.gaps: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def add(self, gap_s: float) -> None:
        self.gaps.append((self.clock(), gap_s))

    def summary(self, since_s: float) -> dict:
        """p50 / p99 / max of the gaps in the last `since_s` seconds, in milliseconds."""
        now = self.clock()
        while self.gaps and self.gaps[0][0] < now - self.span_s:
            self.gaps.popleft()
        recent = sorted(g for t, g in self.gaps if t >= now - since_s)
        if not recent:
            return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}

        def pct(q: float) -> float:
            return round(recent[min(len(recent) - 1, int(q * len(recent)))] * 1000, 1)

        return {"count": len(recent), "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": round(recent[-1] * 1000, 1)}


def snapshot(gw, interval_s: float, stats: EngineStats | None) -> dict:
    """One stats message: engine queues and KV, last step's token split, gateway ITL."""
    wire = stats.as_dict() if stats is not None else {}
    engine = {k: wire[k] for k in _ENGINE_FIELDS if k in wire}
    return {"type": "stats", "time": time.time(), "ready": gw.chat.ready, "draining": gw.chat.draining,
            "engine": engine, "open_streams": len(gw.chat.active), "itl": gw.chat.itl.summary(interval_s),
            "policy": gw.settings.engine.policy, "max_num_seqs": gw.settings.engine.max_num_seqs,
            "max_num_batched_tokens": _budget(gw)}


def _budget(gw) -> int | None:
    """The step's token budget: the configured one, or the one the engine measured ("auto")."""
    budget = gw.settings.engine.max_num_batched_tokens
    return gw.engine.limits.max_num_batched_tokens if budget is None and gw.chat.ready else budget


INTERVALS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)     # a requested interval rounds up to one of these


def interval_class(interval_ms: object, default_s: float = 0.5) -> float:
    ok = isinstance(interval_ms, (int, float)) and not isinstance(interval_ms, bool) and 0 < interval_ms < 1e7
    if not ok:
        return default_s
    i = bisect.bisect_left(INTERVALS_S, interval_ms / 1000 - 1e-9)
    return INTERVALS_S[min(i, len(INTERVALS_S) - 1)]


class Subscriber:
    """One listener's mailbox: the latest stats text, replaced if not yet taken."""

    def __init__(self, interval_s: float, due: float):
        self.interval_s = interval_s
        self.due = due
        self.latest: str | None = None
        self.ready = asyncio.Event()

    def offer(self, text: str) -> None:
        self.latest = text
        self.ready.set()

    async def next(self) -> str:
        await self.ready.wait()
        self.ready.clear()
        return self.latest


class StatsHub:
    TICK_S = INTERVALS_S[0]

    def __init__(self, gw, clock=time.monotonic):
        self.gw = gw
        self.clock = clock
        self.subscribers: set[Subscriber] = set()
        self._task: asyncio.Task | None = None

    def subscribe(self, interval_s: float) -> Subscriber:
        sub = Subscriber(interval_s, self.clock())
        self.subscribers.add(sub)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    async def _run(self) -> None:
        failing: str | None = None                    # the last tick's error, logged once
        while self.subscribers:
            try:
                await self._tick()
                failing = None
            except Exception as exc:                  # a stopped engine, a bug: the next tick tries again
                if repr(exc) != failing:
                    log.exception("stats tick failed; subscribers wait for the next one")
                failing = repr(exc)
            await asyncio.sleep(self.TICK_S)

    async def _tick(self) -> None:
        """One snapshot if anyone is due, rendered once per interval class."""
        now, texts = self.clock(), {}
        due = [sub for sub in self.subscribers if now + 1e-3 >= sub.due]
        stats = await self.gw.engine.stats() if due and self.gw.chat.ready else None
        for sub in due:
            if sub in self.subscribers:
                text = texts.get(sub.interval_s)
                if text is None:
                    text = texts[sub.interval_s] = json.dumps(snapshot(self.gw, sub.interval_s, stats))
                sub.offer(text)
                sub.due = max(sub.due + sub.interval_s, now)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
