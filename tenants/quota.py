"""Quotas: token buckets per minute, concurrency leases and the daily budget.

Two backends share one interface (`QuotaBackend`): this embedded one (in-memory buckets,
SQLite ledger; one process) and `tenants.redis_quota.RedisQuotas` (limits shared by
replicas). Admission is two awaited steps, each all-or-nothing: `begin` takes a
concurrency slot and one request from requests_per_minute before any work is done for
the request (the prompt is not tokenized yet), then `Lease.reserve_tokens` makes the lease
hold the request's exact token count from tokens_per_minute and daily_tokens once it is.
A refusal in the second step leaves the lease holding its slot and request; it is settled
like any other. `begin` takes an estimate of that count: a backend whose steps are round
trips (Redis) may take it at once when it fits with room to spare, so that the second step
costs nothing when the exact count is within it (the excess is given back in the
background); the embedded backend ignores it. Tokens are only ever refused on the exact
count. The Lease is settled (sync, idempotent) exactly once when the request ends,
however it ends: the slot is released, unused tokens go back to the per-minute bucket and
what was used is billed.

`QuotaManager.reserve` (both steps at once, sync) serves the embedded backend's tests.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .billing import Billing
from .buckets import EPS, TokenBucket, format_duration, resize
from .lease import Lease, QuotaBackendUnavailable, QuotaExceeded
from .ledger import Ledger
from .models import Tenant

CONCURRENCY_RETRY_S = 1.0

log = logging.getLogger("streamgate.quota")


class QuotaBackend(Protocol):
    """What the gateway needs from a quota backend; it never knows which one it has."""

    async def begin(self, tenant: Tenant, estimate: int = 0) -> Lease: ...
    def precheck(self, tenant: Tenant) -> None: ...     # raises what begin would, taking nothing
    def headers(self, tenant: Tenant) -> dict[str, str]: ...
    def in_flight(self, tenant_name: str) -> int: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


async def admit(quotas: QuotaBackend, tenant: Tenant, tokens: int) -> Lease:
    """Both admission steps back to back (benchmarks, tests), the count known up front (so
    the Redis backend takes one round trip when it fits): the lease, or QuotaExceeded with
    the lease settled. The gateway tokenizes between the two steps instead."""
    lease = await quotas.begin(tenant, tokens)
    try:
        await lease.reserve_tokens(tokens)
    except BaseException:
        lease.settle(0)
        raise
    return lease


class _State:
    """Per-tenant counters; buckets are None while the limit is unlimited."""

    def __init__(self):
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.in_flight = 0
        self.daily_reserved = 0


class QuotaManager:
    def __init__(self, ledger: Ledger, clock: Callable[[], float] = time.monotonic):
        self.ledger = ledger
        self.clock = clock
        self._lock = threading.Lock()
        self._states: dict[str, _State] = {}
        self._unwritten: dict[str, tuple[Lease, int]] = {}     # lease id -> (lease, used): holds kept
        self.billing = Billing(ledger, self._written)
        for rec in self.billing.replay():        # a previous run's unwritten usage: its tenants wait for it
            log.warning("billing: %d tokens of tenant %r from %s are not in the ledger yet", rec.tokens,
                        rec.tenant, rec.day)

    async def start(self) -> None:
        """Nothing runs in the background here but billing retries (tenants.billing)."""

    async def stop(self) -> None:
        """Stop retrying unwritten usage (it stays spilled for the next start); the ledger
        is closed by its owner."""
        self.billing.close()

    def reserve(self, tenant: Tenant, tokens: int) -> Lease:
        """Take one request and `tokens` from every limit, or raise QuotaExceeded taking nothing."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0 (got {tokens})")
        with self._lock:
            now = self.clock()
            st = self._state(tenant, now)
            self._check_billed(tenant)
            self._check_request(tenant, st, now)
            self._check_tokens(tenant, st, now, tokens)
            self._take_request(st)
            self._take_tokens(st, tokens)
            return Lease(self, tenant, tokens)

    async def begin(self, tenant: Tenant, estimate: int = 0) -> Lease:
        """Take a concurrency slot and one request from requests_per_minute, before any
        work is done for the request, so a flood of expensive requests runs into its own
        tenant's limits first. Reserve its tokens later with `Lease.reserve_tokens`; the
        `estimate` is ignored here (in-process, the second step costs no round trip)."""
        with self._lock:
            now = self.clock()
            st = self._state(tenant, now)
            self._check_billed(tenant)
            self._check_request(tenant, st, now)
            self._take_request(st)
            return Lease(self, tenant, 0)

    def precheck(self, tenant: Tenant) -> None:
        """What `begin` would refuse right now, taking nothing (raises like it): the gateway
        asks before it reads and parses a body, so a tenant over its limits costs nothing."""
        with self._lock:
            now = self.clock()
            self._check_billed(tenant)
            self._check_request(tenant, self._state(tenant, now), now)

    def _check_billed(self, tenant: Tenant) -> None:
        """Billing fails closed: a tenant whose usage could not be written yet gets no new work."""
        if self.billing.blocked(tenant.name):
            raise QuotaBackendUnavailable(f"tenant {tenant.name!r}: usage of earlier requests is not recorded "
                                          "yet (the ledger cannot be written); retry later", retry_after=2.0)

    async def _reserve_more(self, lease: Lease, tokens: int) -> None:
        with self._lock:
            now = self.clock()
            st = self._state(lease._tenant, now)
            self._check_tokens(lease._tenant, st, now, tokens)
            self._take_tokens(st, tokens)
            lease.reserved_tokens += tokens

    def _trim(self, lease: Lease, keep: int) -> None:
        """Give back what the lease holds beyond `keep` (a smaller count than reserved)."""
        with self._lock:
            now = self.clock()
            st = self._state(lease._tenant, now)
            excess, lease.reserved_tokens = lease.reserved_tokens - keep, keep
            st.daily_reserved -= excess
            if st.tokens is not None:
                st.tokens.tokens = min(st.tokens.capacity, st.tokens.available(now) + excess)

    def _refuse(self, st: _State, now: float, reason: str, message: str, retry: float | None) -> QuotaExceeded:
        when = "it can never fit" if retry is None else f"retry in {retry:.1f} s"
        return QuotaExceeded(reason, f"{reason}: {message}; {when}", retry, self._headers(st, now))

    def _check_request(self, tenant: Tenant, st: _State, now: float) -> None:
        lim = tenant.limits
        if lim.max_concurrent is not None and st.in_flight >= lim.max_concurrent:
            raise self._refuse(st, now, "max_concurrent", f"{st.in_flight} requests already in flight "
                               f"(limit {lim.max_concurrent})", CONCURRENCY_RETRY_S)
        if st.requests is not None and st.requests.available(now) + EPS < 1:
            raise self._refuse(st, now, "requests_per_minute", f"the limit of {lim.requests_per_minute} "
                               "requests per minute is used up", st.requests.wait_for(1, now))

    def _check_tokens(self, tenant: Tenant, st: _State, now: float, tokens: int) -> None:
        lim = tenant.limits
        if st.tokens is not None and st.tokens.available(now) + EPS < tokens:
            retry = st.tokens.wait_for(tokens, now)
            left = (f"the limit is {lim.tokens_per_minute} per minute" if retry is None
                    else f"{math.floor(st.tokens.tokens + EPS)} are left")
            raise self._refuse(st, now, "tokens_per_minute", f"this request reserves {tokens} tokens but {left}",
                               retry)
        if lim.daily_tokens is not None:
            try:
                used = self.ledger.used_today(tenant.name)
            except sqlite3.Error as exc:       # never waits (busy timeout 0): fail closed
                raise QuotaBackendUnavailable(f"the usage ledger cannot be read ({type(exc).__name__}); "
                                              "retry later") from None
            if used + st.daily_reserved + tokens > lim.daily_tokens:
                fits = tokens <= lim.daily_tokens
                left = max(0, lim.daily_tokens - used - st.daily_reserved)
                detail = (f"{left} of the daily budget of {lim.daily_tokens} are left "
                          "(resets at 00:00 UTC)" if fits else f"the whole daily budget is {lim.daily_tokens}")
                raise self._refuse(st, now, "daily_tokens", f"this request reserves {tokens} tokens but {detail}",
                                   self.ledger.seconds_to_next_day() if fits else None)

    @staticmethod
    def _take_request(st: _State) -> None:
        if st.requests is not None:
            st.requests.tokens -= 1
        st.in_flight += 1

    @staticmethod
    def _take_tokens(st: _State, tokens: int) -> None:
        if st.tokens is not None:
            st.tokens.tokens -= tokens
        st.daily_reserved += tokens

    def _release(self, lease: Lease, used_tokens: int) -> None:
        """Bill the ledger, then give back the slot and unused tokens and drop the daily
        hold; if the usage cannot be written now, all of that waits until it is."""
        with self._lock:
            if not self.billing.record(lease.tenant, used_tokens, lease.id):
                self._unwritten[lease.id] = (lease, used_tokens)
                return
            self._give_back(lease, used_tokens)

    def _written(self, rec) -> None:
        """A usage record the ledger refused at first is written now (billing thread)."""
        with self._lock:
            held = self._unwritten.pop(rec.lease_id, None)
            if held is not None:
                self._give_back(*held)

    def _give_back(self, lease: Lease, used_tokens: int) -> None:
        """With self._lock held."""
        st = self._states[lease.tenant]
        st.in_flight -= 1
        st.daily_reserved -= lease.reserved_tokens
        if st.tokens is not None:
            bucket, now = st.tokens, self.clock()
            # Refund at most what was taken; an overrun is charged, down to empty.
            bucket.tokens = max(0.0, min(bucket.capacity, bucket.available(now)
                                         + lease.reserved_tokens - used_tokens))

    def headers(self, tenant: Tenant) -> dict[str, str]:
        """OpenAI-style x-ratelimit-* headers; limits that are unlimited are omitted."""
        with self._lock:
            now = self.clock()
            return self._headers(self._state(tenant, now), now)

    def in_flight(self, tenant_name: str) -> int:
        st = self._states.get(tenant_name)
        return st.in_flight if st else 0

    def snapshot(self, tenant: Tenant) -> dict:
        """Current counters (None for unlimited buckets), for tests and metrics."""
        with self._lock:
            now = self.clock()
            st = self._state(tenant, now)
            daily_used = (self.ledger.used_today(tenant.name)
                          if tenant.limits.daily_tokens is not None else None)
            return {
                "in_flight": st.in_flight,
                "requests_available": st.requests.available(now) if st.requests else None,
                "tokens_available": st.tokens.available(now) if st.tokens else None,
                "daily_used": daily_used,
                "daily_reserved": st.daily_reserved,
            }

    def _state(self, tenant: Tenant, now: float) -> _State:
        """The tenant's state, creating it lazily and following limit changes (reloads)."""
        st = self._states.get(tenant.name)
        if st is None:
            st = self._states[tenant.name] = _State()
        st.requests = resize(st.requests, tenant.limits.requests_per_minute, now)
        st.tokens = resize(st.tokens, tenant.limits.tokens_per_minute, now)
        return st

    def _headers(self, st: _State, now: float) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, bucket in (("requests", st.requests), ("tokens", st.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(bucket.capacity)
                out[f"x-ratelimit-remaining-{kind}"] = str(math.floor(bucket.available(now) + EPS))
                out[f"x-ratelimit-reset-{kind}"] = format_duration(bucket.time_to_full(now))
        return out
