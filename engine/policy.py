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
from collections import Counter, deque
from collections.abc import Callable

from .config import EngineConfig
from .sequence import Sequence

INF = math.inf


class Policy:
    name = "base"
    dynamic = False          # keys change as work is scheduled: re-sort after each admission
    ARRIVAL_MEMORY_S = 60.0  # prompt_cap: a class or tenant counts as about this long after its last arrival

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

    def may_share_step(self, first: Sequence, other: Sequence) -> bool:
        """With `isolate_prompts`: whether `other`'s prompt may be admitted in the step that
        admitted `first`'s. Always, but under `priority`. (Under `fair` it was measured: the
        polite tenant's median gained and its p99 lost, to a seat wait later in its burst:
        docs/BENCHMARKS.md §9.14.)"""
        return True

    def prompt_cap(self, seq: Sequence, now: float) -> int | None:
        """Prompt tokens a step may compute for `seq`, shared with every other sequence this
        returns a cap for (None: only the step's budget). Only under `priority` and `fair`."""
        return None

    # Hooks for stateful policies (fair, priority); no-ops elsewhere.
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

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        # The most urgent class that arrived within ARRIVAL_MEMORY_S, as a sliding-window
        # minimum: (arrival, class), classes strictly increasing from front to back. An entry
        # is dropped once a newer arrival of an equal or more urgent class makes it moot, or
        # once it is older than the window, so the deque holds at most one entry per class
        # seen in the window however many a client invents (the priority field is the
        # client's), and each check is O(1).
        self.recent: deque[tuple[float, int]] = deque()

    def on_add(self, seq: Sequence, backlogged: Callable[[], set[str | None]]) -> None:
        at = max(seq.arrival_time, self.recent[-1][0]) if self.recent else seq.arrival_time
        while self.recent and self.recent[-1][1] >= seq.priority:
            self.recent.pop()
        self.recent.append((at, seq.priority))

    def effective_priority(self, seq: Sequence, now: float) -> float:
        return seq.priority - self.config.aging_rate * max(0.0, now - seq.arrival_time)

    def key(self, seq: Sequence, now: float) -> tuple:
        return (self.effective_priority(seq, now), seq.deadline if seq.deadline is not None else INF,
                seq.arrival_time)

    def urgency(self, seq: Sequence, now: float) -> tuple:
        return (seq.priority,)     # preemption compares classes only, so aging cannot ping-pong

    def may_share_step(self, first: Sequence, other: Sequence) -> bool:
        """Not a less urgent class's prompt beside a more urgent class's first token."""
        return other.priority <= first.priority

    def prompt_cap(self, seq: Sequence, now: float) -> int | None:
        """`yielding_prompt_tokens` while a more urgent class has arrived within
        ARRIVAL_MEMORY_S: a step is as long as its prompt tokens on a CPU, and an arriving
        interactive request waits for the step in flight, so batch prompts go in small
        chunks while interactive traffic is about (not only while it is queued: most of
        its arrivals find none of their class there). A batch-only server is not slowed."""
        cap = self.config.yielding_prompt_tokens
        while self.recent and now - self.recent[0][0] > self.ARRIVAL_MEMORY_S:
            self.recent.popleft()
        recent = bool(self.recent) and self.recent[0][1] < seq.priority
        return cap if cap and recent else None


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
    """Virtual token counters per tenant (VTC), weighted, with a bounded burst credit: on
    each arrival a tenant's counter is raised to at least the smallest counter among the
    other backlogged tenants minus `fair_burst_tokens` / weight. A tenant that was idle or
    light may so run up to that much service ahead of its share (its bursts are served
    from the share it left unused), and no more is banked; VTC's own lift is the case
    `fair_burst_tokens=0` (docs/BENCHMARKS.md §9.13)."""

    name = "fair"
    dynamic = True
    INPUT_COST, OUTPUT_COST = 1.0, 2.0

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.counters: dict[str | None, float] = {}
        self.weights: dict[str | None, float] = {}
        self.last_arrival: dict[str | None, float] = {}     # tenant -> its latest arrival time

    def key(self, seq: Sequence, now: float) -> tuple:
        return (self.counters.get(seq.tenant, 0.0), seq.arrival_time)

    def on_add(self, seq: Sequence, backlogged: Callable[[], set[str | None]]) -> None:
        self.last_arrival[seq.tenant] = max(self.last_arrival.get(seq.tenant, -INF), seq.arrival_time)
        self.weights[seq.tenant] = seq.weight
        others = [self.counters.get(t, 0.0) for t in backlogged() if t != seq.tenant]
        floor = min(others) if others else max(self.counters.values(), default=0.0)
        # Strictly under the floor: a tie goes to the tenant back from idle, whose request
        # would otherwise queue behind the backlogged tenant's older ones for a step.
        floor = math.nextafter(floor - self.config.fair_burst_tokens / seq.weight, -INF)
        self.counters[seq.tenant] = max(self.counters.get(seq.tenant, 0.0), floor)

    def may_preempt(self, victim: Sequence, newcomer: Sequence, now: float, running: list[Sequence]) -> bool:
        """VTC orders the queue but cannot open a seat; without a claim, a tenant arriving
        while another holds every seat waits for one of its requests to finish. A newcomer
        may take a seat from another tenant holding at least two:
        - by service: if its tenant's counter, once charged for this prompt, still does not
          lead the victim tenant's. The seat goes where VTC would send the next token, past
          the newcomer's seat share if need be (a light tenant's burst), and cannot move
          straight back: the victim's tenant now leads.
        - by seats, for a tenant holding none: from a tenant over its weighted share of
          `max_num_seqs`, while the newcomer's counter leads by at most one step's budget
          (a prompt longer than the credit, or a counter just charged for a burst; a
          blocked head does not end admission, and this keeps the gap within VTC's bound
          plus that slack)."""
        seats = Counter(s.tenant for s in running)
        if victim.tenant == newcomer.tenant or seats[victim.tenant] < 2:
            return False
        weight = self.weights.get(newcomer.tenant, 1.0)
        lead = self.counters.get(newcomer.tenant, 0.0) - self.counters.get(victim.tenant, 0.0)
        charge = self.INPUT_COST * max(0, newcomer.num_tokens - newcomer.num_billed_tokens) / weight
        if lead + charge <= 0:
            return True
        if seats[newcomer.tenant] or lead > self.config.max_num_batched_tokens / weight:
            return False
        total = sum(self.weights.get(t, 1.0) for t in set(seats) | {newcomer.tenant})
        share = lambda tenant: self.config.max_num_seqs * self.weights.get(tenant, 1.0) / total  # noqa: E731
        return share(newcomer.tenant) >= 1 and seats[victim.tenant] - 1 >= share(victim.tenant)

    def prompt_cap(self, seq: Sequence, now: float) -> int | None:
        """`yielding_prompt_tokens` for a tenant served ahead of (its counter above) another
        tenant that has arrived within ARRIVAL_MEMORY_S: a light tenant's arrival then waits
        for a short step, not for the heavier tenant's long prefill (priority's rule, with
        service in place of class)."""
        cap, mine = self.config.yielding_prompt_tokens, self.counters.get(seq.tenant, 0.0)
        ahead = any(t != seq.tenant and now - at <= self.ARRIVAL_MEMORY_S and self.counters.get(t, 0.0) < mine
                    for t, at in self.last_arrival.items())
        return cap if cap and ahead else None

    def on_served(self, seq: Sequence, prompt_tokens: int, output_tokens: int) -> None:
        cost = self.INPUT_COST * prompt_tokens + self.OUTPUT_COST * output_tokens
        self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + cost / self.weights.get(seq.tenant, 1.0)


_POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FCFS, PriorityPolicy, CostPolicy, FairPolicy)}


def make_policy(config: EngineConfig) -> Policy:
    return _POLICIES[config.policy](config)
