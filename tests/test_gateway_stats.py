"""StatsHub: the cost of the live stats does not grow with the number of listeners."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from engine import EngineConfig, EngineStats
from gateway.live import INTERVALS_S, ItlWindow, StatsHub, interval_class


def fake_gateway(calls: list):
    async def stats():
        calls.append(1)
        return EngineStats(running=1)

    return SimpleNamespace(engine=SimpleNamespace(stats=stats),
                           chat=SimpleNamespace(ready=True, draining=False, active={}, itl=ItlWindow()),
                           settings=SimpleNamespace(engine=EngineConfig()))


async def test_one_snapshot_per_tick_for_a_hundred_listeners():
    """100 subscribers at the same interval cost one engine snapshot per tick, and all get it."""
    calls: list = []
    hub = StatsHub(fake_gateway(calls))
    subs = [hub.subscribe(0.1) for _ in range(100)]
    got = await asyncio.gather(*(s.next() for s in subs))
    await asyncio.sleep(0.25)
    assert {json.loads(text)["engine"]["running"] for text in got} == {1}
    assert 1 <= len(calls) <= 4, len(calls)
    for sub in subs:
        hub.unsubscribe(sub)
    await asyncio.sleep(0.15)
    count = len(calls)
    await asyncio.sleep(0.25)
    assert len(calls) == count          # nobody listens: nothing is computed
    hub.close()


def test_requested_intervals_round_up_to_a_few_classes():
    """Any interval maps to one of a handful of classes (bad values to 500 ms)."""
    assert interval_class(1) == 0.1 and interval_class(100) == 0.1 and interval_class(101) == 0.25
    assert interval_class(10**6) == 10.0 and interval_class(True) == 0.5 and interval_class("x") == 0.5
    assert {interval_class(ms) for ms in range(1, 20000, 7)} <= set(INTERVALS_S)


async def test_a_failing_snapshot_is_logged_once_and_the_stream_goes_on():
    """The engine's stats raise for three ticks (a stopped engine): the hub logs the error
    once, keeps its task, and the subscriber gets the next snapshot once stats answer again."""
    from structlog.testing import capture_logs

    failures = [RuntimeError("engine stopped")] * 3

    async def stats():
        if failures:
            raise failures.pop()
        return EngineStats(running=2)

    gw = fake_gateway([])
    gw.engine.stats = stats
    hub = StatsHub(gw)
    with capture_logs() as logs:
        sub = hub.subscribe(0.1)
        text = await asyncio.wait_for(sub.next(), timeout=10)
    assert json.loads(text)["engine"]["running"] == 2 and not failures
    assert sum("stats tick failed" in e["event"] for e in logs) == 1
    hub.close()
