"""Fair seats and billing on the pure scheduler (no torch, fake clock, the real `update`):
a polite tenant under another tenant's flood, the VTC bound, bounded preemptions, no
recompute billed twice, and the admission-time preemption leak."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock, num_blocks=400, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, watermark=0.0, itl_target_ms=None,
                          **{"policy": "fair", **cfg})
    return Scheduler(config, BlockManager(num_blocks, block_size, config.enable_prefix_caching), clock=clock)


class Load:
    """Drives a scheduler step by step: `arrive` adds requests, the model 'samples' token 7."""

    def __init__(self, sched: Scheduler, clock: Clock, seed: int = 0):
        self.s, self.clock, self.rng = sched, clock, random.Random(seed)
        self.n = 0
        self.seqs: dict[str, Sequence] = {}
        self.arrived: dict[str, int] = {}
        self.first: dict[str, int] = {}
        self.step_no = 0

    def arrive(self, tenant: str, weight: float, prompt: int, max_tokens: int, priority: int = 0) -> Sequence:
        self.n += 1
        rid = f"{tenant}{self.n}"
        seq = Sequence(rid, [self.rng.randrange(100, 10_000) for _ in range(prompt)], SamplingParams(max_tokens=max_tokens),
                       tenant=tenant, weight=weight, arrival_time=self.clock(), priority=priority)
        self.s.add(seq)
        self.seqs[rid], self.arrived[rid] = seq, self.step_no
        return seq

    def step(self) -> None:
        out = self.s.schedule()
        for seq in out.seqs:
            self.first.setdefault(seq.request_id, self.step_no)
        self.s.update(out, [7] * len(out.sampling_seqs))
        self.s.bm.check_invariants(self.s.running)
        self.step_no += 1
        self.clock.now += 1.0

    def queued(self, tenant: str) -> int:
        return sum(1 for s in self.s.waiting if s.tenant == tenant)

    def served(self, tenant: str) -> int:
        inp, out = self.s.counters.served.get(tenant, (0, 0))
        return inp + 2 * out


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_polite_tenant_gets_a_seat_at_once_under_a_flood(weights):
    """A flooder keeps 24 requests queued and every seat full; each request of a polite
    tenant (one every 15 steps) is scheduled within one step of arriving, no sequence
    loses its seat more than max_seat_preemptions times, and the bill is exact: each
    tenant paid for its prompts once and its outputs once, though seats were recomputed."""
    clock = Clock()
    s = make(clock, max_num_seqs=8, max_num_batched_tokens=64)
    load = Load(s, clock)
    w_flood, w_polite = weights
    for step in range(300):
        if step < 240:
            for _ in range(24 - load.queued("flood")):
                load.arrive("flood", w_flood, load.rng.randrange(8, 40), load.rng.randrange(10, 40))
            if step % 15 == 5:
                load.arrive("polite", w_polite, load.rng.randrange(8, 40), load.rng.randrange(4, 12))
        load.step()
    polite = [rid for rid in load.seqs if rid.startswith("polite")]
    waits = [load.first[rid] - load.arrived[rid] for rid in polite]
    assert len(polite) == 16 and max(waits) <= 1, waits
    assert s.counters.seat_preemptions >= 10 and s.counters.preemptions_recompute > 0
    assert max(q.num_seat_preemptions for q in load.seqs.values()) <= s.config.max_seat_preemptions
    while s.has_unfinished():
        load.step()
    for tenant in ("flood", "polite"):
        mine = [q for q in load.seqs.values() if q.tenant == tenant]
        assert s.counters.served[tenant] == [sum(q.num_prompt_tokens for q in mine),
                                             sum(q.num_output_tokens for q in mine)]
    assert s.counters.prompt_tokens > sum(s.counters.served[t][0] for t in ("flood", "polite"))   # recompute ran


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_backlogged_tenants_stay_within_the_vtc_bound_with_seats_on(weights):
    """Both tenants backlogged (a queues 4x as many requests): the weighted service gap
    stays within VTC's 2 x max(longest prompt, one full batch of output tokens x 2) plus
    the seat-claim slack (a tenant under its seat share may take a seat while its counter
    leads by up to one step's budget) at every step, and with weights 2:1 the service
    splits 2:1 within 5 %."""
    clock = Clock()
    seats, longest, budget = 8, 40, 64
    s = make(clock, max_num_seqs=seats, max_num_batched_tokens=budget)
    load = Load(s, clock, seed=1)
    bound = 2 * max(longest, 2 * seats) + budget
    worst = 0.0
    for step in range(600):
        for tenant, backlog, w in (("a", 16, weights[0]), ("b", 4, weights[1])):
            for _ in range(backlog - load.queued(tenant)):
                load.arrive(tenant, w, load.rng.randrange(4, longest + 1), load.rng.randrange(2, 24))
        load.step()
        if step > 20:
            worst = max(worst, abs(load.served("a") / weights[0] - load.served("b") / weights[1]))
    assert worst <= bound, f"weighted service gap {worst} exceeds the VTC bound {bound}"
    ratio = load.served("a") / load.served("b")
    assert abs(ratio - weights[0] / weights[1]) <= 0.05 * weights[0] / weights[1], ratio


def test_seat_quantum_protects_a_freshly_admitted_sequence():
    """A sequence admitted less than seat_quantum_steps ago keeps its seat: the arrival
    waits until the quantum has passed, then takes the seat."""
    clock = Clock()
    s = make(clock, max_num_seqs=2, max_num_batched_tokens=64, seat_quantum_steps=3)
    load = Load(s, clock)
    load.arrive("a", 1.0, 8, 50)
    load.arrive("a", 1.0, 8, 50)
    load.step()                                   # both of a's admitted at step 0
    b = load.arrive("b", 1.0, 8, 5)
    load.step()
    load.step()
    assert b.request_id not in load.first
    load.step()
    assert load.first[b.request_id] == 3 and s.counters.seat_preemptions == 1


def test_preempting_a_victim_scheduled_this_step_returns_its_budget_and_its_charge():
    """Regression: when an arrival preempts a sequence already scheduled in this step, the
    victim's tokens go back to the step's budget (the arrival gets them) and its prompt
    charge is refunded, so its tenant's counter is as if it had not been scheduled."""
    clock = Clock()
    s = make(clock, max_num_seqs=2, max_num_batched_tokens=16)
    load = Load(s, clock)
    load.arrive("a", 1.0, 4, 50)
    clock.now += 0.5
    a1 = load.arrive("a", 1.0, 30, 50)
    load.step()                                   # a0 4 + a1 12
    load.step()                                   # a0 decode + a1 15: 3 left
    counter_before = s.policy.counters["a"]
    billed_before = a1.num_billed_tokens
    load.arrive("b", 1.0, 14, 5)
    out = s.schedule()
    assert a1 in out.preempted and a1 not in out.seqs
    assert [q.tenant for q in out.seqs] == ["a", "b"] and out.num_new_tokens == [1, 14]
    assert a1.num_billed_tokens == billed_before
    assert s.policy.counters["a"] == counter_before      # only output tokens are charged later


@pytest.mark.parametrize("lead", [30, 100])
def test_a_flooders_blocked_queue_head_does_not_hold_back_another_tenants_seat(lead):
    """The flooder holds every seat and heads the queue (its counter is lower), so its next
    request cannot start; a polite tenant under its seat share, whose counter leads by less
    than one step's budget (64), still takes a seat in the next step. With a lead past that
    slack it waits: the VTC order holds beyond it."""
    clock = Clock()
    s = make(clock, max_num_seqs=4, max_num_batched_tokens=64)
    load = Load(s, clock)
    for _ in range(8):
        load.arrive("flood", 1.0, 8, 200)
    for _ in range(4):
        load.step()
    s.policy.counters["polite"] = s.policy.counters["flood"] + lead
    polite = load.arrive("polite", 1.0, 8, 5)
    assert min(s.waiting, key=lambda q: s.policy.key(q, clock())).tenant == "flood"
    load.step()
    if lead < 64:
        assert polite.request_id in load.first and s.counters.seat_preemptions == 1
    else:
        assert polite.request_id not in load.first and s.counters.seat_preemptions == 0


@pytest.mark.parametrize("burst_tokens", [0, 1024])
def test_a_light_tenants_burst_runs_past_its_seat_share_on_its_credit(burst_tokens):
    """A flooder holds all 8 seats and has been served for 300 steps; a tenant that was
    idle sends 6 short requests at once. With a burst credit its counter starts that far
    under the flooder's (exactly `fair_burst_tokens` under it: the idle time banks no
    more), so each request claims a seat by service, past its share of 4, and all 6 start
    within three steps (the victims' quantum). With no credit (VTC's own lift) it is level
    with the flooder: it gets a seat (it held none) but not past its share, and the rest
    wait for seats in VTC order."""
    clock = Clock()
    s = make(clock, max_num_seqs=8, max_num_batched_tokens=64, fair_burst_tokens=burst_tokens)
    load = Load(s, clock)
    for step in range(300):
        for _ in range(16 - load.queued("flood")):
            load.arrive("flood", 1.0, load.rng.randrange(8, 30), load.rng.randrange(60, 120))
        load.step()
    flood = s.policy.counters["flood"]
    assert flood > 4 * burst_tokens
    burst = [load.arrive("light", 1.0, 8, 40) for _ in range(6)]
    assert s.policy.counters["light"] == pytest.approx(flood - burst_tokens)
    for _ in range(3):
        load.step()
    started = sum(q.request_id in load.first for q in burst)
    if burst_tokens:
        assert started == 6
    else:
        assert 1 <= started <= 4, started
    assert max(q.num_seat_preemptions for q in load.seqs.values()) <= s.config.max_seat_preemptions


def test_interactive_request_starts_within_a_step_under_an_aged_batch_flood():
    """priority: batch (class 2) requests fill every seat and queue for 60 s, so aging lifts
    the queued ones past class 0; each interactive (class 0) arrival still takes a batch
    seat within one step, because preemption compares classes only and the aged batch head
    that cannot start does not block it; no batch sequence loses its seat past the limit."""
    clock = Clock()
    s = make(clock, policy="priority", aging_rate=0.1, max_num_seqs=4, max_num_batched_tokens=64)
    load = Load(s, clock)
    waits = []
    for step in range(200):
        for _ in range(10 - load.queued("batch")):
            load.arrive("batch", 1.0, load.rng.randrange(8, 30), load.rng.randrange(20, 60), priority=2)
        if step >= 60 and step % 20 == 0:
            rid = load.arrive("interactive", 1.0, 12, 6, priority=0).request_id
        load.step()
        if step >= 60 and step % 20 == 1:
            waits.append(load.first.get(rid, 10**6) - load.arrived[rid])
    aged = [q for q in s.waiting if q.tenant == "batch" and s.policy.effective_priority(q, clock()) < 0]
    assert aged, "the batch queue should have aged past class 0"
    assert len(waits) == 7 and max(waits) <= 1, waits
    assert max(q.num_seat_preemptions for q in load.seqs.values()) <= s.config.max_seat_preemptions


@pytest.mark.parametrize("policy, isolate", [("priority", True), ("priority", False), ("fair", True)])
def test_an_interactive_prompt_does_not_share_its_step_with_batch_prompts(policy, isolate):
    """With `isolate_prompts` (the default) the step that admits the interactive class's
    prompt admits none of the batch class's, though the budget has room: the first token
    waits for its own prompt only, and the batch prompts start the step after. Off, they
    fill that step's budget beside it; under fair (which does not isolate: §9.14) too. (The
    lower classes' prompt cap is off here: this is isolation alone.)"""
    clock = Clock()
    s = make(clock, max_num_seqs=16, max_num_batched_tokens=256, policy=policy, isolate_prompts=isolate,
             yielding_prompt_tokens=0)
    load = Load(s, clock)
    batch_class = 0 if policy == "fair" else 2
    for _ in range(2):
        load.arrive("flood", 1.0, 40, 50, priority=batch_class)
    load.step()
    load.step()                                              # the flood decodes
    for _ in range(6):
        load.arrive("flood", 1.0, 40, 50, priority=batch_class)
    polite = load.arrive("polite", 1.0, 40, 4)
    out = s.schedule()
    prompts = [q.tenant for q, decode in zip(out.seqs, out.is_decode) if not decode]
    assert prompts[0] == "polite" and polite.request_id in [q.request_id for q in out.seqs]
    if policy == "fair" or not isolate:
        assert prompts.count("flood") >= 4
        return
    assert prompts == ["polite"] and out.budget_left >= 5 * 40
    s.update(out, [7] * len(out.sampling_seqs))
    nxt = s.schedule()
    assert [q.tenant for q, decode in zip(nxt.seqs, nxt.is_decode) if not decode].count("flood") >= 4


def uncapped_then_all_finish(s: Scheduler, load: Load, tenant: str, capped: list[Sequence]) -> None:
    """A 120-token prompt of the tenant yielded to is computed whole in its first step, and
    then every capped request finishes with its 4 tokens."""
    late = load.arrive(tenant, 1.0, 120, 2)
    out = s.schedule()
    assert dict(zip([q.request_id for q in out.seqs], out.num_new_tokens))[late.request_id] == 120
    while s.has_unfinished():
        s.update(out, [7] * len(out.sampling_seqs))
        out = s.schedule()
    assert all(q.status.finished and q.num_output_tokens == 4 for q in capped)


@pytest.mark.parametrize("cap", [32, 0])
def test_batch_prompts_go_in_small_chunks_while_interactive_traffic_is_about(cap):
    """priority: once an interactive request has arrived, the batch class's prompts compute
    at most `yielding_prompt_tokens` a step, together (an interactive arrival then waits
    for a short step), and still all finish; an interactive prompt is never capped. Before
    any interactive arrival, and with the cap off, batch prompts fill the budget."""
    clock = Clock()
    s = make(clock, max_num_seqs=16, max_num_batched_tokens=256, policy="priority", yielding_prompt_tokens=cap)
    load = Load(s, clock)
    load.arrive("batch", 1.0, 100, 4, priority=2)
    out = s.schedule()
    assert out.num_prefill_tokens == 100                     # no interactive class seen yet
    s.update(out, [7] * len(out.sampling_seqs))
    load.arrive("interactive", 1.0, 4, 40)
    load.step()
    batch = [load.arrive("batch", 1.0, 100, 4, priority=2) for _ in range(3)]
    for _ in range(20):
        left = sum(q.num_uncomputed_tokens for q in batch if q.is_prefill and not q.status.finished)
        out = s.schedule()
        prompt = sum(n for q, n, p in zip(out.seqs, out.num_new_tokens, out.computes_prompt) if p and q.priority == 2)
        assert prompt == min(left, cap or out.token_budget) or out.budget_left == 0    # the cap, or the budget, is full
        s.update(out, [7] * len(out.sampling_seqs))
        clock.now += 1.0
    uncapped_then_all_finish(s, load, "interactive", batch)


def test_fair_a_tenant_served_ahead_prefills_in_small_chunks_while_another_is_about():
    """fair: once the polite tenant has arrived, the flooder (served ahead) computes at most
    `yielding_prompt_tokens` of prompt a step, and its prompts still all finish; the polite
    tenant's own prompt is not capped."""
    clock = Clock()
    s = make(clock, max_num_seqs=16, max_num_batched_tokens=256, yielding_prompt_tokens=32)
    load = Load(s, clock)
    load.arrive("flood", 1.0, 100, 4)
    load.step()                                              # alone: its whole prompt in one step
    assert s.last_output.num_prefill_tokens == 100
    load.arrive("polite", 1.0, 4, 30)
    load.step()
    flood = [load.arrive("flood", 1.0, 100, 4) for _ in range(3)]
    for _ in range(12):
        out = s.schedule()
        assert sum(n for q, n, p in zip(out.seqs, out.num_new_tokens, out.computes_prompt)
                   if p and q.tenant == "flood") <= 32
        s.update(out, [7] * len(out.sampling_seqs))
        clock.now += 1.0
    uncapped_then_all_finish(s, load, "polite", flood)
