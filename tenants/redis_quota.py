"""Quotas shared by every replica through Redis: the QuotaBackend for N replicas.

Admission is one EVALSHA (tenants/redis_scripts.py) when it can be, two when it must,
each all-or-nothing on Redis's clock. `begin` (BEGIN) frees leases whose heartbeat
stopped, takes a concurrency lease and one request before the prompt is tokenized (issue
10), and with them the caller's token estimate when tokens/min and the daily budget hold
`prepay_headroom` times it. `Lease.reserve_tokens` sends nothing if the exact count is
within what was prepaid (a background TRIM gives the excess back); otherwise TOKENS takes
the difference or refuses on the exact count, so no tenant is refused for an estimate nor
over-runs. Until its trim lands, a prepaid excess leaves the tenant's other requests that
much less room; the headroom rule keeps this away from the limits, where it is exact.
`Lease.settle` stays sync: it writes the settlement to a local SQLite outbox, and a
background task sends it (pipelined with other settlements and trims), replaying the
outbox after any Redis failure or a restart; the settle script ignores a lease id it has
seen, so nothing is billed twice. Another task renews this replica's leases every
`lease_ttl / 3` seconds in one pipelined round trip, so a replica killed with SIGKILL
frees its leases within `lease_ttl`.

Redis unreachable (or refusing, e.g. read-only) at admission: QuotaBackendUnavailable
(fail closed); the client reconnects on the next call, so service resumes without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import uuid
from collections import defaultdict

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .models import Tenant
from .outbox import Outbox, Settlement
from .redis_outbox import SettlementSender
from .quota import Lease, QuotaBackendUnavailable
from .redis_scripts import (BEGIN, RENEW, SETTLE, TOKENS, TRIM, headers_from_levels, limit_arg, refusal,
                            reply_float)

log = logging.getLogger(__name__)

UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
FAILED = (RedisError, OSError)      # unreachable, or refused (OOM, READONLY, a script error)
RETRY_UNAVAILABLE_S = 1.0
PREPAY_HEADROOM = 2.0


class RedisQuotas(SettlementSender):
    def __init__(self, url: str, outbox_path: str | os.PathLike = ":memory:", *,
                 lease_ttl: float = 10.0, prefix: str = "sg", timeout: float = 1.0,
                 prepay_headroom: float = PREPAY_HEADROOM):
        # One immediate retry reconnects a pooled socket that Redis closed (a restart);
        # more would only delay the 503 while Redis is down. Never on a timeout: the script
        # may have run with only its reply late, and TOKENS is not idempotent (BEGIN is,
        # by lease id, SETTLE and TRIM are).
        self.redis = Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                    retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self.outbox = Outbox(outbox_path)
        self.lease_ttl = lease_ttl
        self.prefix = prefix
        self.prepay_headroom = prepay_headroom
        self._begin = self.redis.register_script(BEGIN)
        self._tokens = self.redis.register_script(TOKENS)
        self._settle = self.redis.register_script(SETTLE)
        self._renew = self.redis.register_script(RENEW)
        self._trim_script = self.redis.register_script(TRIM)
        self._leases: dict[str, tuple[Lease, int]] = {}  # live leases here: id -> (lease, tpm)
        self._trims: dict[str, Settlement] = {}           # id -> tokens to keep, not yet sent
        self._unwritten: dict[str, Settlement] = {}       # settlements the outbox refused, not yet in Redis
        self._unwritten_by_tenant: defaultdict[str, int] = defaultdict(int)
        self._headers: dict[str, dict[str, str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []

    def keys(self, tenant: str) -> dict[str, str]:
        tag = f"{{{self.prefix}:{tenant}}}"
        return {k: f"{tag}:{k}" for k in ("q", "leases", "held", "billed", "expired", "settled")}

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the heartbeat and the settlement sender; the sender first replays what
        a previous run of this replica left in the outbox."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._wake.set()
        self._tasks = [asyncio.create_task(self._send_settlements(), name="quota-settle"),
                       asyncio.create_task(self._heartbeat(), name="quota-heartbeat")]

    async def stop(self, flush_timeout: float = 2.0) -> None:
        """Try to send what is pending (it stays in the outbox otherwise), then stop."""
        try:
            await asyncio.wait_for(self.flush(), flush_timeout)
        except (asyncio.TimeoutError, *FAILED) as exc:
            log.warning("quota outbox: %d settlements left for the next start (%s)",
                        len(self.outbox), exc.__class__.__name__)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.redis.aclose()
        self.outbox.close()

    # -- admission -------------------------------------------------------------------

    def precheck(self, tenant: Tenant) -> None:
        """Only what is known here without a round trip: usage not yet durable refuses."""
        if self._unwritten_by_tenant[tenant.name]:
            raise QuotaBackendUnavailable(f"tenant {tenant.name!r}: usage of earlier requests is not recorded yet "
                                          "(the outbox cannot be written); retry later", retry_after=2.0)

    async def begin(self, tenant: Tenant, estimate: int = 0) -> Lease:
        """Take a concurrency lease and one request in one round trip (and `estimate`
        tokens, prepaid, when they fit with headroom), or raise QuotaExceeded taking
        nothing; QuotaBackendUnavailable when Redis is unreachable or refuses."""
        self.precheck(tenant)
        lim, k = tenant.limits, self.keys(tenant.name)
        lease_id, tpm = uuid.uuid4().hex, limit_arg(lim.tokens_per_minute)
        try:
            prepaid = await self._run(
                tenant, 0, self._begin, [k["q"], k["leases"], k["held"], k["billed"], k["expired"], k["settled"]],
                [limit_arg(lim.requests_per_minute), tpm, limit_arg(lim.max_concurrent), limit_arg(lim.daily_tokens),
                 lease_id, int(self.lease_ttl * 1000), max(0, estimate), self.prepay_headroom])
        except asyncio.CancelledError:
            # The script may have run and only its reply was lost (the client left): release
            # what it may have taken now rather than at the TTL. Settling a lease Redis never
            # took is a no-op. (A reply lost to a socket timeout waits for the TTL.)
            self._enqueue(Settlement(lease_id, tenant.name, 0, tpm))
            raise
        lease = Lease(self, tenant, prepaid, lease_id=lease_id)
        self._leases[lease_id] = (lease, tpm)
        return lease

    async def _reserve_more(self, lease: Lease, tokens: int) -> None:
        """`Lease.reserve_tokens`: tokens/min and the daily budget in one round trip."""
        tenant = lease._tenant
        lim, k = tenant.limits, self.keys(tenant.name)
        total = lease.reserved_tokens + tokens
        await self._run(tenant, total, self._tokens, [k["q"], k["leases"], k["held"], k["billed"]],
                        [limit_arg(lim.requests_per_minute), limit_arg(lim.tokens_per_minute),
                         limit_arg(lim.daily_tokens), tokens, lease.id, total])
        lease.reserved_tokens = total

    def _trim(self, lease: Lease, keep: int) -> None:
        """`Lease.reserve_tokens` within the prepaid tokens: the excess goes back in the
        background (TRIM, pipelined with the settlements), not on the request's path."""
        lease.reserved_tokens = keep
        _, tpm = self._leases.get(lease.id, (lease, -1))
        self._trims[lease.id] = Settlement(lease.id, lease.tenant, keep, tpm)
        self._wake_sender()

    async def _run(self, tenant: Tenant, tokens: int, script, keys: list[str], args: list) -> int:
        """Run an admission script; its refusal becomes the embedded backend's QuotaExceeded.
        Returns the tokens it prepaid."""
        try:
            ok, reason, retry, info, req, tok, prepaid = await script(keys=keys, args=args)
        except FAILED as exc:
            what = "cannot be reached" if isinstance(exc, UNREACHABLE) else f"refused the admission ({exc})"
            raise QuotaBackendUnavailable(
                f"quota_backend_unavailable: the shared quota store (Redis) {what} "
                f"({exc.__class__.__name__}); retry in {RETRY_UNAVAILABLE_S:.0f} s",
                RETRY_UNAVAILABLE_S) from None
        headers = self._headers[tenant.name] = headers_from_levels(tenant, reply_float(req), reply_float(tok))
        if ok:
            return prepaid
        if reason == b"lease_expired":
            raise QuotaBackendUnavailable(
                "quota_backend_unavailable: this replica could not renew the request's lease in "
                f"time; retry in {RETRY_UNAVAILABLE_S:.0f} s", RETRY_UNAVAILABLE_S)
        raise refusal(tenant, reason.decode(), reply_float(retry), reply_float(info), tokens, headers)

    def headers(self, tenant: Tenant) -> dict[str, str]:
        """x-ratelimit-* headers as of this replica's last admission for the tenant (no
        extra round trip: the admission script returns the bucket levels)."""
        return dict(self._headers.get(tenant.name, {}))

    def in_flight(self, tenant_name: str) -> int:
        """Leases held by this replica (Redis counts every replica's: see `snapshot`)."""
        return sum(1 for lease, _ in self._leases.values() if lease.tenant == tenant_name)

    async def snapshot(self, tenant: Tenant) -> dict:
        """Redis's view of the tenant across replicas, for tests, tools and metrics."""
        k = self.keys(tenant.name)
        now_s, now_us = await self.redis.time()
        day = str(int(now_s) // 86400)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcount(k["leases"], now_s * 1000 + now_us // 1000, "+inf")
            pipe.hget(k["q"], "reserved")
            pipe.hget(k["billed"], day)
            live, reserved, billed = await pipe.execute()
        return {"in_flight": live, "daily_reserved": int(reserved or 0),
                "daily_used": int(billed or 0)}

    # -- settlement ------------------------------------------------------------------

    def _release(self, lease: Lease, used_tokens: int) -> None:
        """Called once by `Lease.settle` (any thread): durable locally first, sent later."""
        _, tpm = self._leases.pop(lease.id, (lease, -1))
        self._trims.pop(lease.id, None)   # the settlement gives back all it holds
        self._enqueue(Settlement(lease.id, lease.tenant, used_tokens, tpm))

    def _enqueue(self, settlement: Settlement) -> None:
        """Durable in the outbox, or (it cannot be written: locked, disk full) kept in memory
        and sent from there; until then its tenant is refused new work (billing fails closed)."""
        try:
            self.outbox.add(settlement)
        except sqlite3.Error as exc:
            log.error("quota outbox: cannot write a settlement (%s: %s); tenant %r is refused new work "
                      "until Redis has it", exc.__class__.__name__, exc, settlement.tenant)
            self._unwritten[settlement.lease_id] = settlement
            self._unwritten_by_tenant[settlement.tenant] += 1
        self._wake_sender()

    def _wake_sender(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- heartbeat -------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            try:
                await self.renew()
            except FAILED as exc:
                log.warning("quota heartbeat: Redis failed (%s: %s); leases expire after "
                            "%.1f s without renewal", exc.__class__.__name__, exc, self.lease_ttl)

    async def renew(self) -> None:
        """Push the expiry of every live lease of this replica, one pipelined round trip."""
        by_tenant: dict[str, list[str]] = defaultdict(list)
        for lease_id, (lease, _) in list(self._leases.items()):
            by_tenant[lease.tenant].append(lease_id)
        if by_tenant:
            ttl_ms = int(self.lease_ttl * 1000)
            results = await self._evalsha_many([(self._renew, [self.keys(t)["leases"]], [ttl_ms, *ids])
                                                for t, ids in by_tenant.items()])
            for r in results:
                if isinstance(r, Exception):
                    raise r

    async def _evalsha_many(self, calls: list[tuple[object, list, list]]) -> list:
        """EVALSHA each (script, keys, args) in one pipelined round trip; results in order,
        a call's error as its result. If Redis lost scripts (a restart: NOSCRIPT), load
        them and send again (the scripts are idempotent)."""
        for _ in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            lost = {calls[i][0] for i, r in enumerate(results) if isinstance(r, NoScriptError)}
            if not lost:
                break
            for script in lost:
                await self.redis.script_load(script.script)
        return results

