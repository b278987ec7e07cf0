"""The scheduler under pressure, on a tiny model with a fake clock (one tick per step):
forced preemption keeps parity, priorities with aging, VTC fairness, deadlines, queue
limits and metrics."""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest

from engine import EngineConfig, EngineOverloaded, LLMEngine, SamplingParams
from tests.conftest import DEVICES
from tests.models import assert_greedy_parity, load_reference, run_to_completion

GREEDY = dict(temperature=0.0, ignore_eos=True)


class Tick:
    """A fake monotonic clock the test advances by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine(tiny_model, clock=None, **cfg) -> LLMEngine:
    """A tiny-model engine with a 256-block pool unless the test sizes it: the default 1 GiB
    pool never fills for these tests and costs a second of allocation per engine."""
    return LLMEngine(EngineConfig(model=tiny_model("llama"), **{"num_kv_blocks": 256, **cfg}),
                     **({"clock": clock} if clock else {}))


def prompt(rng, n):
    return [rng.randrange(100, 40_000) for _ in range(n)]


@pytest.mark.parametrize("device_dtype", DEVICES)
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_forced_preemption_keeps_parity_and_leaks_nothing(tiny_model, mode, device_dtype):
    """A 20-block pool for 8 growing requests forces preemption in each mode; outputs equal
    HF greedy and every device and host block is free at the end."""
    device, dtype = device_dtype
    rng = random.Random(3)
    arrivals = {2 * i: [(f"r{i}", prompt(rng, [40, 70, 20, 90][i % 4]), SamplingParams(max_tokens=40, **GREEDY))]
                for i in range(8)}
    eng = LLMEngine(EngineConfig(model=tiny_model("llama"), device=device, dtype=dtype, num_kv_blocks=20, block_size=8,
                                 max_num_batched_tokens=64, max_num_seqs=8, watermark=0.0, preemption_mode=mode,
                                 num_swap_blocks=64, swap_min_tokens=60))
    outputs = run_to_completion(eng, arrivals)
    ref = load_reference(tiny_model("llama"), device, dtype)
    for reqs in arrivals.values():
        for rid, p, params in reqs:
            assert_greedy_parity(ref, p, outputs[rid], 1e-4 if dtype == "float32" else 0.15)
    s = eng.stats()
    if mode == "recompute":
        assert s["preemptions_recompute"] > 0 and s["preemptions_swap"] == 0
    elif mode == "swap":
        assert s["preemptions_swap"] > 0 and s["preemptions_recompute"] == 0 and s["swapped_bytes"] > 0
    else:
        assert s["preemptions_swap"] > 0 and s["preemptions_recompute"] > 0
    assert s["kv_blocks_used"] == 0 and s["host_blocks_used"] == 0 and s["swapped"] == 0
    eng.block_manager.check_invariants([])


def run_load(eng, clock, arrive, steps):
    """Advance `steps` ticks; `arrive(step)` returns requests to add at that step.
    Returns ({rid: first-output step}, {rid: finish step})."""
    first, done = {}, {}
    for step in range(steps):
        for rid, p, params, kw in arrive(step):
            eng.add_request(rid, p, params, **kw)
        for out in eng.step():
            if out.new_token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = step
        clock.now += 1.0
    return first, done


def test_priority_cuts_queue_time_and_aging_bounds_the_wait(tiny_model):
    """Class-0 requests arrive at exactly the batch's capacity for 300 steps, class-1 ones
    now and then: class 0 waits less on average; with aging every class-1 request starts
    within a bounded wait, and without aging class 1 starves."""
    def arrive(step):
        reqs = []
        if step % 2 == 0:
            reqs.append((f"hi{step}", [5 + step % 7, 6, 7], SamplingParams(max_tokens=4, **GREEDY), {"priority": 0}))
        if step % 10 == 0 and step < 60:
            reqs.append((f"lo{step}", [8, 6 + step % 5, 7], SamplingParams(max_tokens=4, **GREEDY), {"priority": 1}))
        return reqs

    results, finished = {}, {}
    for aging in (0.05, 0.0):
        clock = Tick()
        eng = engine(tiny_model, clock, policy="priority", aging_rate=aging, max_num_seqs=2, max_num_batched_tokens=64)
        results[aging], finished[aging] = run_load(eng, clock, arrive, 300)
    first = results[0.05]
    lows = [f"lo{s}" for s in range(0, 60, 10)]
    assert all(rid in first and rid in finished[0.05] for rid in lows), "a low-priority request starved despite aging"
    wait = {c: [first[rid] - int(rid[2:]) for rid in first if rid.startswith(c)] for c in ("hi", "lo")}
    assert sum(wait["hi"]) / len(wait["hi"]) < sum(wait["lo"]) / len(wait["lo"])
    assert max(wait["lo"]) <= 80
    assert not all(rid in results[0.0] for rid in lows), "without aging, class-0 load should starve class 1"


def test_higher_priority_arrival_preempts_a_full_batch(tiny_model):
    """With the batch full of class-1 requests, a class-0 arrival preempts one and starts
    in the very next step."""
    clock = Tick()
    eng = engine(tiny_model, clock, policy="priority", max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(2):
        eng.add_request(f"lo{i}", [9, 9, i + 1], SamplingParams(max_tokens=50, **GREEDY), priority=1)
    eng.step()
    eng.step()
    eng.add_request("hi", [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY), priority=0)
    outs = {o.request_id: o for o in eng.step()}
    assert outs["hi"].new_token_ids and eng.stats()["num_preemptions"] == 1
    first, done = run_load(eng, clock, lambda s: [], 200)
    assert {"lo0", "lo1", "hi"} <= set(done)


def test_batch_prompts_chunked_small_beside_interactive_keep_parity(tiny_model):
    """priority with yielding_prompt_tokens=8: once an interactive request has arrived,
    two long batch prompts are computed 8 tokens a step between them (so over many steps,
    beside the interactive decodes), and every output still equals HF greedy."""
    clock = Tick()
    eng = engine(tiny_model, clock, policy="priority", max_num_seqs=4, max_num_batched_tokens=64,
                 yielding_prompt_tokens=8)
    rng = random.Random(5)
    prompts = {"hi": prompt(rng, 12), "lo0": prompt(rng, 70), "lo1": prompt(rng, 45)}
    eng.add_request("hi", prompts["hi"], SamplingParams(max_tokens=30, **GREEDY), priority=0)
    outputs = {rid: [] for rid in prompts}
    for rid in ("lo0", "lo1"):
        eng.add_request(rid, prompts[rid], SamplingParams(max_tokens=6, **GREEDY), priority=2)
    prompt_steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            outputs[o.request_id].extend(o.new_token_ids)
        b = eng.scheduler.last_output
        lower = sum(n for q, n, p in zip(b.seqs, b.num_new_tokens, b.computes_prompt) if p and q.priority == 2)
        assert lower <= 8
        prompt_steps += lower > 0
        clock.now += 1.0
    assert prompt_steps >= (70 + 45) // 8
    ref = load_reference(tiny_model("llama"))
    for rid, p in prompts.items():
        assert_greedy_parity(ref, p, outputs[rid], 1e-4)


def served_cost(eng, tenant):
    inp, out = eng.stats()["tenant_served_tokens"].get(tenant, (0, 0))
    return inp + 2 * out


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_fair_policy_keeps_backlogged_tenants_within_the_vtc_bound(tiny_model, weights):
    """Two tenants kept backlogged (A sends 4x as many requests): with equal weights the
    served weighted tokens stay within 2 x max(longest prompt cost, one full batch's output
    cost), plus the seat-claim slack of one step's budget (docs/ENGINE.md: seats), at every
    step; with weights 2:1 service splits about 2:1."""
    clock = Tick()
    seats, rng = 4, random.Random(5)
    eng = engine(tiny_model, clock, policy="fair", max_num_seqs=seats, max_num_batched_tokens=64)
    longest = 24
    counter = {"a": 0, "b": 0}

    def keep_backlogged(step):
        reqs = []
        for tenant, backlog in (("a", 16), ("b", 4)):
            queued = sum(1 for s in eng.scheduler.waiting if s.tenant == tenant)
            for _ in range(backlog - queued):
                counter[tenant] += 1
                w = weights[0] if tenant == "a" else weights[1]
                reqs.append((f"{tenant}{counter[tenant]}", prompt(rng, rng.randrange(4, longest + 1)),
                             SamplingParams(max_tokens=rng.randrange(2, 12), **GREEDY), {"tenant": tenant, "weight": w}))
        return reqs

    bound = 2 * max(longest * 1, 2 * seats) + eng.config.max_num_batched_tokens
    worst = 0.0
    for step in range(250):
        run_load(eng, clock, lambda s, st=step: keep_backlogged(st), 1)
        a, b = served_cost(eng, "a") / weights[0], served_cost(eng, "b") / weights[1]
        if step > 10:
            worst = max(worst, abs(a - b))
    a, b = served_cost(eng, "a"), served_cost(eng, "b")
    if weights == (1.0, 1.0):
        assert worst <= bound, f"weighted service gap {worst} exceeds the VTC bound {bound}"
    else:
        assert 1.7 <= a / b <= 2.3, f"service split {a / b:.2f}, want ~2"


def test_fair_newcomer_takes_a_seat_from_a_tenant_above_its_share(tiny_model):
    """fair with preemption at admission: with both seats held by tenant a, tenant b's
    arrival preempts one of a's sequences and starts at once (each tenant's share is one
    seat); a second b request then waits, as b is at its share; a's outputs stay exact."""
    clock = Tick()
    eng = engine(tiny_model, clock, policy="fair", max_num_seqs=2, max_num_batched_tokens=16,
                 preempt_for_priority=True)
    params = SamplingParams(max_tokens=40, **GREEDY)
    prompts = {f"a{i}": [9, 9, i + 1] for i in range(2)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, params, tenant="a")
    outputs = {rid: [] for rid in prompts}
    for _ in range(5):
        for o in eng.step():
            outputs[o.request_id].extend(o.new_token_ids)
    eng.add_request("b0", [5, 6, 7], SamplingParams(max_tokens=30, **GREEDY), tenant="b")
    eng.add_request("b1", [5, 6, 8], SamplingParams(max_tokens=3, **GREEDY), tenant="b")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["b0"].new_token_ids and "b1" not in outs
    for o in outs.values():
        outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert eng.stats()["num_preemptions"] == 1
    running = sorted(s.tenant for s in eng.scheduler.running)
    assert running == ["a", "b"]
    while eng.has_unfinished():
        for o in eng.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert len(outputs["b0"]) == 30 and len(outputs["b1"]) == 3
    ref = load_reference(tiny_model("llama"))
    for rid, p in prompts.items():
        assert_greedy_parity(ref, p, outputs[rid], 1e-4)


def test_fcfs_lets_a_flooding_tenant_take_over(tiny_model):
    """The contrast: under fcfs the tenant sending 4x the requests gets far more service."""
    clock = Tick()
    eng = engine(tiny_model, clock, policy="fcfs", max_num_seqs=4, max_num_batched_tokens=64)
    n = {"a": 0, "b": 0}

    def arrive(step):
        reqs = []
        for tenant, per_step in (("a", 4), ("b", 1)):
            for _ in range(per_step):
                n[tenant] += 1
                reqs.append((f"{tenant}{n[tenant]}", [5, 6, 7, 8], SamplingParams(max_tokens=6, **GREEDY), {"tenant": tenant}))
        return reqs if step < 100 else []

    run_load(eng, clock, arrive, 100)
    assert served_cost(eng, "a") > 2.5 * served_cost(eng, "b")


def test_deadlines_drop_waiting_requests_and_finish_running_ones(tiny_model):
    """A request whose deadline passes while queued ends with 'deadline' and no tokens, never
    prefilled; a running one ends with 'deadline' after some tokens; blocks free that step."""
    clock = Tick()
    eng = engine(tiny_model, clock, max_num_seqs=1, max_num_batched_tokens=64)
    eng.add_request("run", [5, 6, 7], SamplingParams(max_tokens=100, **GREEDY), deadline=clock.now + 10)
    eng.add_request("queued", list(range(10, 50)), SamplingParams(max_tokens=5, **GREEDY), deadline=clock.now + 3)
    first, done = run_load(eng, clock, lambda s: [], 5)
    assert done.get("queued") == 3 and "queued" not in first
    assert eng.stats()["deadline_drops"] == 1 and eng.stats()["prompt_tokens"] == 3   # only "run" was prefilled
    got = []
    for _ in range(8):
        got += eng.step()
        clock.now += 1.0
    final = [o for o in got if o.finished]
    assert [(o.request_id, o.finish_reason) for o in final] == [("run", "deadline")]
    assert final[0].num_output_tokens > 5
    assert eng.stats()["kv_blocks_used"] == 0 and eng.stats()["deadline_finishes"] == 1


def test_queue_limits_raise_engine_overloaded(tiny_model):
    """Past max_queued_requests or max_queued_tokens, add_request raises EngineOverloaded and
    queues nothing; the requests already queued still run."""
    eng = engine(tiny_model, max_queued_requests=3, max_queued_tokens=100)
    for i in range(3):
        eng.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))
    with pytest.raises(EngineOverloaded, match="max_queued_requests") as err:
        eng.add_request("r3", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))
    assert err.value.limit == "max_queued_requests"
    eng2 = engine(tiny_model, max_queued_tokens=100)
    eng2.add_request("big", list(range(1, 90)), SamplingParams(max_tokens=2, **GREEDY))
    with pytest.raises(EngineOverloaded, match="max_queued_tokens"):
        eng2.add_request("more", list(range(1, 20)), SamplingParams(max_tokens=2, **GREEDY))
    assert eng.stats()["rejections"] == 1 and eng.stats()["waiting"] == 3
    finished = set()
    while eng.has_unfinished():
        finished |= {o.request_id for o in eng.step() if o.finished}
    assert finished == {"r0", "r1", "r2"}


def test_metrics_expose_the_scheduler(tiny_model):
    """Prometheus text carries queue gauges, preemption counters and latency histograms."""
    eng = engine(tiny_model, num_kv_blocks=12, block_size=8, watermark=0.0, max_num_batched_tokens=64)
    rng = random.Random(9)
    run_to_completion(eng, {0: [(f"m{i}", prompt(rng, 30), SamplingParams(max_tokens=30, **GREEDY)) for i in range(4)]})
    text = generate_latest(eng.metrics.registry).decode()
    for name in ("streamgate_num_requests_waiting", "streamgate_kv_cache_usage", "streamgate_batch_occupancy",
                 "streamgate_prefix_cache_hit_rate", "streamgate_num_requests_starving",
                 "streamgate_deadline_drops_total", "streamgate_swapped_bytes_total"):
        assert name in text, name
    assert 'streamgate_num_preemptions_total{mode="recompute"}' in text
    assert "streamgate_time_to_first_token_seconds_count 4.0" in text
    assert "streamgate_inter_token_latency_seconds_count 116.0" in text      # 4 x 29 gaps
    assert "streamgate_e2e_request_latency_seconds_count 4.0" in text


def test_a_long_preempted_sequence_is_always_readmitted(tiny_model):
    """With a 20% watermark, max_model_len is capped so that a sequence that grew while
    preempted still fits alone: both requests finish instead of blocking the queue."""
    for mode in ("recompute", "swap"):
        eng = engine(tiny_model, num_kv_blocks=10, block_size=4, watermark=0.2, max_num_batched_tokens=64,
                     preemption_mode=mode, num_swap_blocks=16, swap_min_tokens=0)
        assert eng.max_model_len == 8 * 4
        arrivals = {0: [("a", list(range(40, 52)), SamplingParams(max_tokens=100, **GREEDY)),
                        ("b", list(range(10, 30)), SamplingParams(max_tokens=100, **GREEDY))]}
        out = run_to_completion(eng, arrivals)
        assert len(out["a"]) == 20 and len(out["b"]) == 12
        assert eng.stats()["num_preemptions"] > 0 and eng.stats()["kv_blocks_used"] == 0
