"""Quotas: per-minute buckets, concurrency leases, daily budgets and rate-limit headers."""

from __future__ import annotations

import calendar
import threading

import pytest
from tenants import Ledger, Limits, QuotaExceeded, QuotaManager, Tenant
from tenants.quota import format_duration

MIDNIGHT_SOON = calendar.timegm((2024, 5, 1, 23, 0, 0))  # one hour before a UTC midnight


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def tenant(**limits) -> Tenant:
    return Tenant(name="acme", key_hashes=("0" * 64,), limits=Limits(**limits))


def manager(ledger: Ledger | None = None) -> tuple[QuotaManager, FakeClock]:
    clock = FakeClock()
    return QuotaManager(ledger or Ledger(clock=FakeClock(MIDNIGHT_SOON)), clock=clock), clock


def refusal(qm: QuotaManager, t: Tenant, tokens: int) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as e:
        qm.reserve(t, tokens)
    return e.value


def test_unlimited_tenant_always_admitted():
    """A tenant without limits is admitted and gets no rate-limit headers."""
    qm, _ = manager()
    t = tenant()
    leases = [qm.reserve(t, 10**6) for _ in range(100)]
    assert qm.in_flight("acme") == 100 and qm.headers(t) == {}
    assert all(lease.settle(1) for lease in leases) and qm.in_flight("acme") == 0


def test_rpm_refusal_then_refill():
    """At 60 rpm the 61st request waits 1 s (retry_after) and then succeeds."""
    qm, clock = manager()
    t = tenant(requests_per_minute=60)
    for _ in range(60):
        qm.reserve(t, 0).settle(0)
    err = refusal(qm, t, 0)
    assert err.reason == "requests_per_minute" and err.retry_after == pytest.approx(1.0)
    assert "requests_per_minute" in str(err) and "retry in 1.0 s" in str(err)
    clock.advance(0.5)
    assert refusal(qm, t, 0).retry_after == pytest.approx(0.5)
    clock.advance(0.5)
    qm.reserve(t, 0)
    assert refusal(qm, t, 0).reason == "requests_per_minute"


def test_tpm_reservation_refunded_at_settle():
    """Unused reserved tokens return to the per-minute bucket when the lease settles."""
    qm, _ = manager()
    t = tenant(tokens_per_minute=1000)
    lease = qm.reserve(t, 800)
    assert qm.snapshot(t)["tokens_available"] == pytest.approx(200)
    assert lease.settle(300)
    assert qm.snapshot(t)["tokens_available"] == pytest.approx(700)


def test_refund_never_exceeds_what_was_taken():
    """A settle refunds at most the reservation and never overfills the bucket."""
    qm, clock = manager()
    t = tenant(tokens_per_minute=600)
    lease = qm.reserve(t, 500)
    clock.advance(60)
    lease.settle(0)
    assert qm.snapshot(t)["tokens_available"] == pytest.approx(600)


def test_overrun_is_charged_and_billed():
    """Using more than reserved empties the bucket further and bills the real usage."""
    qm, _ = manager()
    t = tenant(tokens_per_minute=1000, daily_tokens=10**6)
    qm.reserve(t, 100).settle(250)
    snap = qm.snapshot(t)
    assert snap["tokens_available"] == pytest.approx(750) and snap["daily_used"] == 250


def test_tpm_refusal_message_and_retry_after():
    """A tpm refusal says what is reserved and left, and when a retry can succeed."""
    qm, _ = manager()
    t = tenant(tokens_per_minute=20000)
    qm.reserve(t, 19700)
    err = refusal(qm, t, 1200)
    assert err.reason == "tokens_per_minute" and err.retry_after == pytest.approx(2.7)
    assert str(err) == ("tokens_per_minute: this request reserves 1200 tokens but 300 are left; "
                        "retry in 2.7 s")


def test_tpm_refusal_consumes_no_request_token():
    """All-or-nothing: a request refused by tpm does not use up an rpm token or a slot."""
    qm, _ = manager()
    t = tenant(requests_per_minute=2, tokens_per_minute=100, max_concurrent=5)
    qm.reserve(t, 90)
    before = qm.snapshot(t)
    refusal(qm, t, 50)
    assert qm.snapshot(t) == before
    qm.reserve(t, 10)  # the second rpm token is still there
    assert refusal(qm, t, 0).reason == "requests_per_minute"


def test_concurrency_slot_returned_by_settle():
    """max_concurrent refuses while the slots are held and admits once one is settled."""
    qm, _ = manager()
    t = tenant(max_concurrent=2)
    a, _b = qm.reserve(t, 1), qm.reserve(t, 1)
    err = refusal(qm, t, 1)
    assert err.reason == "max_concurrent" and err.retry_after == 1.0
    assert a.settle(1) and qm.in_flight("acme") == 1
    qm.reserve(t, 1)
    assert qm.in_flight("acme") == 2 and qm.in_flight("nobody") == 0


def test_checks_run_in_documented_order():
    """max_concurrent is reported before rpm, rpm before tpm, tpm before daily."""
    qm, _ = manager()
    t = tenant(max_concurrent=1, requests_per_minute=1, tokens_per_minute=10, daily_tokens=10)
    qm.reserve(t, 10)
    assert refusal(qm, t, 10).reason == "max_concurrent"
    t2 = tenant(requests_per_minute=1, tokens_per_minute=10, daily_tokens=10)
    assert refusal(qm, t2, 10).reason == "requests_per_minute"
    qm, _ = manager()
    t3 = tenant(tokens_per_minute=10, daily_tokens=10)
    qm.reserve(t3, 10)
    assert refusal(qm, t3, 1).reason == "tokens_per_minute"


def test_settle_exactly_once():
    """A second settle returns False and changes nothing: no double refund or billing."""
    led = Ledger(clock=FakeClock(MIDNIGHT_SOON))
    qm, _ = manager(led)
    t = tenant(tokens_per_minute=1000, max_concurrent=4, daily_tokens=10**6)
    lease, other = qm.reserve(t, 500), qm.reserve(t, 100)
    assert lease.settle(200) is True and lease.settled
    before = qm.snapshot(t)
    assert lease.settle(200) is False and lease.settle(0) is False
    assert qm.snapshot(t) == before and led.used_today("acme") == 200
    assert qm.in_flight("acme") == 1 and not other.settled


def test_concurrent_settles_release_once():
    """Settling one lease from many threads at once releases it exactly once."""
    qm, _ = manager()
    t = tenant(max_concurrent=2, daily_tokens=1000)
    qm.reserve(t, 1)
    lease = qm.reserve(t, 10)
    barrier = threading.Barrier(8)
    results = []

    def go():
        barrier.wait()
        results.append(lease.settle(10))

    threads = [threading.Thread(target=go) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results.count(True) == 1 and qm.in_flight("acme") == 1
    assert qm.snapshot(t)["daily_used"] == 10


def test_daily_budget_counts_in_flight_reservations():
    """In-flight reservations count against the daily budget; retry is at UTC midnight."""
    qm, _ = manager()
    t = tenant(daily_tokens=1000)
    qm.reserve(t, 600).settle(500)
    held = qm.reserve(t, 400)
    err = refusal(qm, t, 200)
    assert err.reason == "daily_tokens" and err.retry_after == pytest.approx(3600.0)
    assert "100 of the daily budget of 1000 are left" in str(err)
    held.settle(0)
    qm.reserve(t, 200)


def test_daily_budget_survives_restart_and_resets_next_utc_day(tmp_path):
    """Daily usage persists across a new Ledger and QuotaManager, and resets after midnight."""
    path = tmp_path / "usage.sqlite"
    wall = FakeClock(MIDNIGHT_SOON)
    t = tenant(daily_tokens=1000)
    led = Ledger(path, clock=wall)
    QuotaManager(led, clock=FakeClock()).reserve(t, 1000).settle(900)
    led.close()

    led = Ledger(path, clock=wall)  # "restart"
    qm = QuotaManager(led, clock=FakeClock())
    assert qm.snapshot(t)["daily_used"] == 900
    err = refusal(qm, t, 200)
    assert err.reason == "daily_tokens" and err.retry_after == pytest.approx(3600.0)
    wall.advance(3600)
    qm.reserve(t, 1000).settle(1000)
    assert led.used_today("acme") == 1000
    led.close()


def test_retry_after_none_when_it_can_never_fit():
    """A reservation larger than the tpm capacity or the whole daily budget never fits."""
    qm, _ = manager()
    err = refusal(qm, tenant(tokens_per_minute=1000), 1001)
    assert err.reason == "tokens_per_minute" and err.retry_after is None
    assert "never fit" in str(err)
    err = refusal(qm, tenant(daily_tokens=1000), 1001)
    assert err.reason == "daily_tokens" and err.retry_after is None
    assert "whole daily budget is 1000" in str(err)


def test_headers_format():
    """Headers follow OpenAI's names, count what is left and give the time until full."""
    qm, clock = manager()
    t = tenant(requests_per_minute=600, tokens_per_minute=6000)
    assert qm.headers(t) == {
        "x-ratelimit-limit-requests": "600", "x-ratelimit-remaining-requests": "600",
        "x-ratelimit-reset-requests": "0s", "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "6000", "x-ratelimit-reset-tokens": "0s"}
    qm.reserve(t, 6000)
    h = qm.headers(t)
    assert h["x-ratelimit-remaining-requests"] == "599"
    assert h["x-ratelimit-reset-requests"] == "100ms"
    assert h["x-ratelimit-remaining-tokens"] == "0" and h["x-ratelimit-reset-tokens"] == "1m0s"
    clock.advance(30)
    assert qm.headers(t)["x-ratelimit-reset-tokens"] == "30s"
    assert refusal(qm, t, 5000).headers["x-ratelimit-remaining-tokens"] == "3000"


def test_headers_omit_unlimited():
    """Only limited buckets produce headers."""
    qm, _ = manager()
    assert set(qm.headers(tenant(tokens_per_minute=10))) == {
        "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.25, "250ms"), (0.0001, "1ms"), (1, "1s"), (1.5, "1.5s"),
    (360, "6m0s"), (3723, "1h2m3s"), (59.9996, "1m0s"),
])
def test_format_duration(seconds, text):
    """Durations are Go-style strings, rounded up to the millisecond."""
    assert format_duration(seconds) == text


def test_limit_change_resizes_bucket():
    """A reloaded tenant with a lower tpm gets a bucket of the new size, not a fresh one."""
    qm, _ = manager()
    qm.reserve(tenant(tokens_per_minute=1000), 900)
    assert qm.snapshot(tenant(tokens_per_minute=50))["tokens_available"] == pytest.approx(50)
    assert qm.snapshot(tenant(tokens_per_minute=500))["tokens_available"] == pytest.approx(50)
