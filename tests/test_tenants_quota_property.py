"""Property: random reserve/settle/advance sequences keep quota counters within limits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tenants import Ledger, Limits, QuotaExceeded, QuotaManager, Tenant
from tests.test_tenants_quota import FakeClock


LIMITS = Limits(max_concurrent=2, requests_per_minute=3, tokens_per_minute=300, daily_tokens=250)
OPS = st.lists(st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 160)),
    st.tuples(st.just("settle"), st.integers(0, 20), st.floats(0, 1)),
    st.tuples(st.just("advance"), st.floats(0, 10)),
), max_size=80)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_random_reserve_settle_respects_limits(ops):
    """Any reserve/settle/advance sequence keeps every counter within its limit and balanced."""
    clock = FakeClock()
    qm = QuotaManager(Ledger(clock=FakeClock(1.7e9)), clock=clock)
    t = Tenant(name="acme", key_hashes=("0" * 64,), limits=LIMITS)
    leases, billed = [], 0
    for op in ops:
        if op[0] == "reserve":
            try:
                leases.append(qm.reserve(t, op[1]))
            except QuotaExceeded as e:
                assert e.retry_after is None or e.retry_after >= 0
        elif op[0] == "settle" and leases:
            lease = leases[op[1] % len(leases)]
            used = int(lease.reserved_tokens * op[2])
            first = not lease.settled
            assert lease.settle(used) is first
            billed += used if first else 0
        elif op[0] == "advance":
            clock.advance(op[1])
        open_ = [x for x in leases if not x.settled]
        snap = qm.snapshot(t)
        assert snap["in_flight"] == len(open_) <= LIMITS.max_concurrent
        assert snap["daily_reserved"] == sum(x.reserved_tokens for x in open_)
        assert snap["daily_used"] == billed
        assert snap["daily_used"] + snap["daily_reserved"] <= LIMITS.daily_tokens
        assert 0 <= snap["requests_available"] <= LIMITS.requests_per_minute
        assert 0 <= snap["tokens_available"] <= LIMITS.tokens_per_minute
    for lease in leases:
        lease.settle(0)
    assert qm.in_flight("acme") == 0 and qm.snapshot(t)["daily_reserved"] == 0
