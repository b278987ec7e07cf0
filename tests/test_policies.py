"""Each policy's ordering rule on hand-built queues (no torch, fake clock)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.policy import make_policy
from engine.sequence import Sequence


def seq(rid, *, t=0.0, prio=0, n=10, max_tokens=16, tenant=None, deadline=None, weight=1.0, computed=0):
    s = Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), priority=prio, tenant=tenant,
                 deadline=deadline, arrival_time=t, weight=weight)
    s.num_computed_tokens = computed
    return s


def order(policy, seqs, now):
    return [s.request_id for s in sorted(seqs, key=lambda s: policy.key(s, now))]


def test_fcfs_orders_by_arrival():
    """fcfs: earliest arrival first, whatever the priority or size."""
    p = make_policy(EngineConfig(policy="fcfs"))
    seqs = [seq("c", t=3, prio=0), seq("a", t=1, prio=9, n=1000), seq("b", t=2)]
    assert order(p, seqs, now=5) == ["a", "b", "c"]


def test_priority_orders_by_class_then_deadline_then_arrival():
    """priority: lower class first; within a class the earlier deadline, then arrival."""
    p = make_policy(EngineConfig(policy="priority", aging_rate=0.0))
    seqs = [seq("low", t=0, prio=2), seq("hi-late", t=2, prio=0), seq("hi-dl", t=3, prio=0, deadline=50.0),
            seq("hi-dl-early", t=4, prio=0, deadline=20.0), seq("mid", t=1, prio=1)]
    assert order(p, seqs, now=5) == ["hi-dl-early", "hi-dl", "hi-late", "mid", "low"]


def test_priority_aging_lets_old_low_priority_requests_through():
    """With aging 0.1 class/s, a class-2 request waiting 30 s outranks a fresh class-0 one;
    after 10 s it does not yet."""
    p = make_policy(EngineConfig(policy="priority", aging_rate=0.1))
    old, fresh = seq("old", t=0, prio=2), seq("fresh", t=30, prio=0)
    assert order(p, [fresh, old], now=30) == ["old", "fresh"]
    old2, fresh2 = seq("old", t=0, prio=2), seq("fresh", t=10, prio=0)
    assert order(p, [old2, fresh2], now=10) == ["fresh", "old"]


def test_priority_victim_is_worst_class_then_least_progress():
    """Victims: the least urgent class first; within it, the one with the least progress."""
    p = make_policy(EngineConfig(policy="priority"))
    seqs = [seq("hi", prio=0), seq("lo-far", prio=3, computed=90), seq("lo-new", prio=3, computed=5)]
    victim = max(seqs, key=lambda s: p.victim_key(s, 0.0))
    assert victim.request_id == "lo-new"


def test_cost_prefers_cheap_requests_with_aging():
    """cost: a short prompt with few output tokens goes before a long document; the long one
    overtakes after waiting long enough."""
    p = make_policy(EngineConfig(policy="cost", aging_rate=0.1))
    short, long = seq("short", t=10, n=20, max_tokens=16), seq("long", t=10, n=2000, max_tokens=256)
    medium = seq("medium", t=10, n=200, max_tokens=64)
    assert order(p, [long, medium, short], now=10) == ["short", "medium", "long"]
    aged_long = seq("long", t=0, n=2000, max_tokens=256)
    fresh_short = seq("short", t=100, n=20, max_tokens=16)
    assert order(p, [fresh_short, aged_long], now=100) == ["long", "short"]


def test_fair_serves_the_least_served_tenant_and_divides_by_weight():
    """fair: counters grow by input x1 + output x2 over the weight; least counter first."""
    p = make_policy(EngineConfig(policy="fair"))
    a, b = seq("a1", tenant="a", weight=2.0), seq("b1", tenant="b", weight=1.0)
    p.on_add(a, set)
    p.on_add(b, lambda: {"a"})
    p.on_served(a, 100, 10)        # (100 + 20) / 2 = 60
    p.on_served(b, 50, 10)         # 50 + 20 = 70
    assert p.counters == {"a": 60.0, "b": 70.0}
    assert order(p, [seq("b2", t=0, tenant="b"), seq("a2", t=1, tenant="a")], now=2) == ["a2", "b2"]


@pytest.mark.parametrize("credit", [0, 300])
def test_fair_returning_tenant_starts_its_credit_under_the_backlogged_minimum(credit):
    """A tenant back from idle is lifted to (just under) the smallest counter among the
    backlogged tenants minus the burst credit, so no more idle time than the credit is
    banked and it wins the tie against the backlogged tenant's older requests; a tenant
    already within the credit keeps its counter, and a backlogged tenant that fell further
    behind is lifted too (the credit bounds the lag)."""
    p = make_policy(EngineConfig(policy="fair", fair_burst_tokens=credit))
    p.counters = {"a": 500.0, "b": 800.0, "idle": 10.0, "ahead": 900.0}
    p.on_add(seq("x", tenant="idle"), backlogged=lambda: {"a", "b"})
    assert 499.999 - credit < p.counters["idle"] < 500.0 - credit
    assert order(p, [seq("a-old", t=0, tenant="a"), seq("x", t=5, tenant="idle")], now=6) == ["x", "a-old"]
    p.on_add(seq("y", tenant="ahead"), backlogged=lambda: {"a", "b"})
    assert p.counters["ahead"] == 900.0
    p.on_add(seq("z", tenant="new"), backlogged=lambda: {"a", "b"})
    assert 499.999 - credit < p.counters["new"] < 500.0 - credit
    p.counters["a"] = 100.0                                  # backlogged, far behind b
    p.on_add(seq("w", tenant="a"), backlogged=lambda: {"a", "b"})
    assert p.counters["a"] == pytest.approx(800.0 - credit, abs=1e-3)


def test_which_prompts_may_share_a_step_with_the_first():
    """isolate_prompts: under priority a less urgent class's prompt waits for the next step
    beside a more urgent class's, an equal or more urgent one shares it; fcfs, cost and fair
    never hold a prompt back."""
    prio = make_policy(EngineConfig(policy="priority"))
    assert not prio.may_share_step(seq("i", prio=0), seq("b", prio=2))
    assert prio.may_share_step(seq("b", prio=2), seq("i", prio=0))
    assert prio.may_share_step(seq("i", prio=1), seq("i2", prio=1))
    for name in ("fcfs", "cost", "fair"):
        assert make_policy(EngineConfig(policy=name)).may_share_step(seq("i", prio=0, tenant="a"),
                                                                      seq("b", prio=2, tenant="b"))


def test_lower_classes_prompt_cap_while_a_more_urgent_class_is_about():
    """priority: a class's prompts are capped (yielding_prompt_tokens a step) while a more
    urgent class has arrived within ARRIVAL_MEMORY_S, not before one ever arrives, not after it
    has been gone that long, never the most urgent class's; 0 turns it off; fcfs and cost
    never cap."""
    p = make_policy(EngineConfig(policy="priority", yielding_prompt_tokens=48))
    batch, inter = seq("b", t=0.0, prio=2), seq("i", t=100.0, prio=0)
    p.on_add(batch, backlogged=set)
    assert p.prompt_cap(batch, now=100.0) is None            # a batch-only server is not slowed
    p.on_add(inter, backlogged=set)
    assert p.prompt_cap(batch, now=100.0) == 48
    assert p.prompt_cap(seq("m", prio=1), now=100.0 + p.ARRIVAL_MEMORY_S) == 48
    assert p.prompt_cap(batch, now=100.1 + p.ARRIVAL_MEMORY_S) is None
    assert p.prompt_cap(inter, now=100.0) is None
    off = make_policy(EngineConfig(policy="priority", yielding_prompt_tokens=0))
    off.on_add(inter, backlogged=set)
    assert off.prompt_cap(batch, now=100.0) is None
    for name in ("fcfs", "cost"):
        other = make_policy(EngineConfig(policy=name))
        other.on_add(inter, backlogged=set)
        assert other.prompt_cap(batch, now=100.0) is None


def test_fair_caps_the_prompts_of_a_tenant_served_ahead_of_another_recent_one():
    """fair: a tenant whose counter is above that of another tenant arrived within
    ARRIVAL_MEMORY_S has its prompts capped; the tenant behind is not; nor is anyone once the
    other has been gone that long, nor a tenant alone; 0 turns it off."""
    p = make_policy(EngineConfig(policy="fair", yielding_prompt_tokens=40))
    flood, polite = seq("f", t=0.0, tenant="flood"), seq("p", t=10.0, tenant="polite")
    p.on_add(flood, backlogged=lambda: {"flood"})
    p.on_served(flood, 500, 0)
    assert p.prompt_cap(flood, now=10.0) is None              # alone: nobody to yield to
    p.on_add(polite, backlogged=lambda: {"flood", "polite"})
    assert p.counters["polite"] < p.counters["flood"]
    assert p.prompt_cap(flood, now=10.0) == 40 and p.prompt_cap(polite, now=10.0) is None
    assert p.prompt_cap(flood, now=10.1 + p.ARRIVAL_MEMORY_S) is None
    p.on_served(polite, 5000, 0)                              # now polite is ahead: it yields
    assert p.prompt_cap(polite, now=11.0) == 40 and p.prompt_cap(flood, now=11.0) is None
    off = make_policy(EngineConfig(policy="fair", yielding_prompt_tokens=0))
    off.on_add(flood, backlogged=set)
    off.on_served(flood, 500, 0)
    off.on_add(polite, backlogged=set)
    assert off.prompt_cap(flood, now=10.0) is None
