"""Scheduling policies: one ordering rule each.

`key(seq, now)` orders the waiting queue and the running batch: smaller is served first.
`victim_key(seq, now)` orders preemption victims: larger is preempted first (least urgent,
then least progress, i.e. cheapest to redo). `urgency(seq, now)` is what "never preempt a
more urgent sequence for a less urgent one" compares.

- fcfs      arrival order.
- priority  class (lower first), improved by waiting time (aging) so no request waits
            forever; within a class, earlier deadlines first.
- cost      cheapest first by estimated prefill + decode + KV cost, with aging.
- fair      virtual token counters per tenant (VTC, OSDI'24): the tenant that has been
            served least (input tokens x1 + output tokens x2, over its weight) goes first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from .config import EngineConfig
from .sequence import Sequence

INF = math.inf


class Policy:
    name = "base"
    dynamic = False          # keys change as work is scheduled: re-sort after each admission

    def __init__(self, config: EngineConfig):
        self.config = config

    def key(self, seq: Sequence, now: float) -> tuple:
        raise NotImplementedError

    def urgency(self, seq: Sequence, now: float) -> tuple:
        return self.key(seq, now)

    def victim_key(self, seq: Sequence, now: float) -> tuple:
        return (self.urgency(seq, now), -seq.num_computed_tokens)

    def may_preempt(self, victim: Sequence, newcomer: Sequence, now: float, running: list[Sequence]) -> bool:
        """Whether `newcomer` may take `victim`'s seat at admission (with preemption on):
        only a strictly less urgent class. Classes only: aging orders the queue, but if it
        counted here a batch request aged past a fresh interactive one on a slow host would
        keep its seat and the interactive one would wait for it. A victim cannot be
        preempted forever: the scheduler gives each sequence a quantum and a limit."""
        return victim.priority > newcomer.priority

    # Hooks for stateful policies (fair); no-ops elsewhere.
    def on_add(self, seq: Sequence, backlogged: Callable[[], set[str | None]]) -> None:
        """A request arrived; `backlogged()` gives the tenants with queued or running work."""

    def on_served(self, seq: Sequence, prompt_tokens: int, output_tokens: int) -> None:
        pass


class FCFS(Policy):
    """First come, first served."""

    name = "fcfs"

    def key(self, seq: Sequence, now: float) -> tuple:
        return (seq.arrival_time,)


class PriorityPolicy(Policy):
    """Lower priority value first; waiting improves it by `aging_rate` classes per second.
    Earlier deadlines first within a class."""

    name = "priority"

    def effective_priority(self, seq: Sequence, now: float) -> float:
        return seq.priority - self.config.aging_rate * max(0.0, now - seq.arrival_time)

    def key(self, seq: Sequence, now: float) -> tuple:
        return (self.effective_priority(seq, now), seq.deadline if seq.deadline is not None else INF,
                seq.arrival_time)

    def urgency(self, seq: Sequence, now: float) -> tuple:
        return (seq.priority,)     # preemption compares classes only, so aging cannot ping-pong


class CostPolicy(Policy):
    """Cheapest first: cost ≈ prefill tokens × 1 + expected decode tokens × 4 + KV blocks × 2
    (a decode token costs a whole step of latency; blocks are memory pressure), minus
    `aging_rate × cost_aging_tokens` per second waited so long requests are not starved."""

    name = "cost"
    PREFILL, DECODE, KV = 1.0, 4.0, 2.0
    AGING_TOKENS = 1000.0               # one "class" of aging is worth this many cost units

    def cost(self, seq: Sequence) -> float:
        decode_left = max(0, min(seq.params.max_tokens, 256) - seq.num_output_tokens)
        blocks = -(-(seq.num_tokens + decode_left) // self.config.block_size)
        return self.PREFILL * seq.num_uncomputed_tokens + self.DECODE * decode_left + self.KV * blocks

    def key(self, seq: Sequence, now: float) -> tuple:
        aged = self.config.aging_rate * self.AGING_TOKENS * max(0.0, now - seq.arrival_time)
        return (self.cost(seq) - aged, seq.arrival_time)


class FairPolicy(Policy):
    """Virtual token counters per tenant, weighted. A tenant returning from idle starts at
    the smallest counter among backlogged tenants, so idleness is not banked."""

    name = "fair"
    dynamic = True
    INPUT_COST, OUTPUT_COST = 1.0, 2.0

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.counters: dict[str | None, float] = {}
        self.weights: dict[str | None, float] = {}

    def key(self, seq: Sequence, now: float) -> tuple:
        return (self.counters.get(seq.tenant, 0.0), seq.arrival_time)

    def on_add(self, seq: Sequence, backlogged: Callable[[], set[str | None]]) -> None:
        self.weights[seq.tenant] = seq.weight
        tenants = backlogged()
        if seq.tenant not in tenants:
            active = [self.counters.get(t, 0.0) for t in tenants]
            floor = min(active) if active else max(self.counters.values(), default=0.0)
            # Just under the floor: a tie goes to the tenant back from idle, whose request
            # would otherwise queue behind the backlogged tenant's older ones for a step.
            self.counters[seq.tenant] = max(self.counters.get(seq.tenant, 0.0), math.nextafter(floor, -INF))

    def may_preempt(self, victim: Sequence, newcomer: Sequence, now: float, running: list[Sequence]) -> bool:
        """Seats are shared by weight too: a tenant holding fewer seats than its weighted
        share of `max_num_seqs` may take one from a tenant holding more than its own. VTC
        orders the queue but cannot open a seat; without this, a tenant arriving while a
        flooder holds every seat waits for one of the flooder's requests to finish. Both
        sides stay within their shares, so a seat never moves back and forth. And only
        while the newcomer's counter leads the victim's by at most one step's budget:
        the claim may bypass VTC order (a blocked head does not end admission), and this
        keeps the service gap within VTC's bound plus that slack."""
        if victim.tenant == newcomer.tenant:
            return False
        seats = Counter(s.tenant for s in running)
        present = set(seats) | {newcomer.tenant}
        total = sum(self.weights.get(t, 1.0) for t in present)

        def share(tenant) -> float:
            return self.config.max_num_seqs * self.weights.get(tenant, 1.0) / total

        lead = self.counters.get(newcomer.tenant, 0.0) - self.counters.get(victim.tenant, 0.0)
        return (seats[newcomer.tenant] + 1 <= share(newcomer.tenant) and seats[victim.tenant] - 1 >= share(victim.tenant)
                and lead <= self.config.max_num_batched_tokens / self.weights.get(newcomer.tenant, 1.0))

    def on_served(self, seq: Sequence, prompt_tokens: int, output_tokens: int) -> None:
        cost = self.INPUT_COST * prompt_tokens + self.OUTPUT_COST * output_tokens
        self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + cost / self.weights.get(seq.tenant, 1.0)


_POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FCFS, PriorityPolicy, CostPolicy, FairPolicy)}


def make_policy(config: EngineConfig) -> Policy:
    return _POLICIES[config.policy](config)
