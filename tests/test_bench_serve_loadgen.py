"""Workload files become fixed request lists (bench/serving/loadgen.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from bench.serving.loadgen import Req, Workload, WorkloadError, load_workload, make_requests
from bench.serving.replay import replay

SHIPPED = ("mixed", "two_tenants", "priority", "closed_loop", "two_tenants_weighted_closed")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_workloads_load_and_stay_small(name):
    """Every shipped workload loads, is bounded, and stays sized for a 2-core SmolLM2 run."""
    wl = load_workload(name)
    reqs = make_requests(wl)
    assert 0 < len(reqs) <= wl.num_requests <= 80
    assert sum(r.max_tokens for r in reqs) <= 4500
    assert all(r.at is None or r.at <= wl.duration_s for r in reqs)


def test_same_seed_same_requests():
    """Loading a workload twice gives identical requests, prompts included."""
    a, b = make_requests(load_workload("mixed")), make_requests(load_workload("mixed"))
    assert a == b and a[0].messages == b[0].messages


def test_rate_scales_arrivals_and_keeps_prompts():
    """--rate scales every arrival time and keeps each request's tenant, class and prompt."""
    wl = load_workload("two_tenants")
    base = make_requests(wl)
    total = sum(wl.tenant_rates().values())
    fast = make_requests(wl.with_rate(2 * total))
    assert len(fast) >= len(base)
    for a, b in zip(base, fast):
        assert (a.tenant, a.cls, a.messages, a.max_tokens) == (b.tenant, b.cls, b.messages, b.max_tokens)
        assert b.at == pytest.approx(a.at / 2)


def test_tenant_rates_set_the_mix_of_tenants():
    """A tenant at five times another's rate sends about five times as many requests."""
    wl = load_workload("two_tenants")
    reqs = make_requests(replace(wl, num_requests=2000, duration_s=10_000))
    flood = sum(r.tenant == "flood" for r in reqs)
    assert 4 < flood / (len(reqs) - flood) < 6.5


def test_closed_loop_assigns_users_and_tenants(tmp_path):
    """In a closed loop request i belongs to user i mod users; users split by tenant share."""
    path = tmp_path / "c.toml"
    path.write_text('arrival = "closed"\nnum_requests = 9\nusers = 3\n'
                    '[[tenants]]\nname = "a"\nshare = 2\n[[tenants]]\nname = "b"\nshare = 1\n'
                    '[[mix]]\nname = "x"\nprompt_words = [5, 5]\nmax_tokens = [2, 2]\n')
    reqs = make_requests(load_workload(str(path)))
    assert [r.user for r in reqs] == [0, 1, 2] * 3 and all(r.at is None for r in reqs)
    assert [r.tenant for r in reqs[:3]] == ["a", "a", "b"]


def test_bad_workload_names_the_field(tmp_path):
    """An invalid field is reported by name."""
    path = tmp_path / "bad.toml"
    path.write_text('rate = 1\n[[mix]]\nname = "x"\nprompt_words = [10, 5]\nmax_tokens = [2, 2]\n')
    with pytest.raises(WorkloadError, match=r"mix\[0\]\.prompt_words"):
        load_workload(str(path))
    with pytest.raises(WorkloadError, match="no such workload"):
        load_workload("no-such-workload")


def test_replay_is_bounded_by_the_time_limit():
    """At the time limit running requests are cancelled ('time_limit'), unsent ones are
    'not_sent', and a client-side exception is recorded, not raised."""
    wl = Workload(name="w", arrival="poisson", rate=1.0)
    reqs = [Req(name, "t", "c", at, None, 0.0, []) for name, at in
            (("fast", 0.0), ("slow", 0.0), ("broken", 0.0), ("late", 5.0))]
    cancelled = []

    async def send(req, rec, t0):
        rec["send"] = time.perf_counter() - t0
        if req.id == "broken":
            raise OSError("boom")
        if req.id == "slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(req.id)
                raise
        rec["deltas"].append([rec["send"], 1])
        rec["end"] = rec["send"]

    start = time.perf_counter()
    recs = {r["id"]: r for r in asyncio.run(replay(reqs, wl, send, time_limit=0.3))}
    assert time.perf_counter() - start < 3
    assert recs["fast"]["error"] is None and recs["slow"]["error"] == "time_limit" and cancelled == ["slow"]
    assert recs["broken"]["error"].startswith("client_error: OSError") and recs["late"]["error"] == "not_sent"
