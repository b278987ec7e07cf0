"""Issue 25 item 6: the priority policy's memory of recent arrivals is bounded however many
distinct `priority` values clients send, and answers like a per-class table would."""

from __future__ import annotations

import random

from engine.config import EngineConfig
from engine.policy import make_policy
from tests.test_policies import seq


def test_distinct_priorities_do_not_grow_the_policy():
    """100k requests, each with a new class (ascending, the worst order: nothing is moot by
    class), spread over longer than the memory: only the window's arrivals are kept."""
    p = make_policy(EngineConfig(policy="priority", yielding_prompt_tokens=48))
    window = p.ARRIVAL_MEMORY_S
    for i in range(100_000):
        t = i * window / 1000               # 1000 arrivals per window
        p.on_add(seq(f"r{i}", t=t, prio=10 + i), backlogged=set)
        p.prompt_cap(seq("probe", prio=5), now=t)
    assert len(p.recent) <= 1001


def test_the_window_minimum_matches_a_full_table():
    """Random classes and times: the cap is given exactly when some more urgent class
    arrived within ARRIVAL_MEMORY_S (checked against a table of every arrival)."""
    rng = random.Random(7)
    p = make_policy(EngineConfig(policy="priority", yielding_prompt_tokens=48))
    arrivals, now = [], 0.0
    for i in range(3000):
        now += rng.random() * p.ARRIVAL_MEMORY_S / 3
        prio = rng.randrange(-3, 6)
        p.on_add(seq(f"r{i}", t=now, prio=prio), backlogged=set)
        arrivals.append((now, prio))
        probe = rng.randrange(-3, 6)
        expected = any(c < probe and now - t <= p.ARRIVAL_MEMORY_S for t, c in arrivals)
        assert (p.prompt_cap(seq("probe", prio=probe), now=now) == 48) == expected, i
