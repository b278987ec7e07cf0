"""Quotas shared by every replica through Redis: the QuotaBackend for N replicas.

Admission is two EVALSHAs (tenants/redis_scripts.py), each all-or-nothing on Redis's
clock: `begin` (BEGIN) frees leases whose heartbeat stopped, then takes a concurrency
lease and one request; `Lease.reserve_tokens` (TOKENS) takes tokens/min and the daily
budget once the prompt is tokenized. Two round trips, not one, because a request must
count against requests/min and concurrency before its prompt is tokenized (issue 10)
and its token cost is only known after. `Lease.settle` stays sync: it writes
the settlement to a local SQLite outbox, and a background task sends it (one EVALSHA per
settlement, pipelined when several wait), replaying the outbox after a failure or a
restart; the settle script ignores a lease id it has seen, so nothing is billed twice.
Another task renews this replica's leases every `lease_ttl / 3` seconds in one pipelined
round trip, so a replica killed with SIGKILL frees its leases within `lease_ttl`.

Redis unreachable at admission: QuotaBackendUnavailable (fail closed); the client
reconnects on the next call, so service resumes when Redis does, without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import uuid
from collections import defaultdict

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .models import Tenant
from .outbox import Outbox, Settlement
from .buckets import EPS, format_duration
from .quota import CONCURRENCY_RETRY_S, Lease, QuotaBackendUnavailable, QuotaExceeded
from .redis_scripts import BEGIN, RENEW, SETTLE, TOKENS

log = logging.getLogger(__name__)

UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
RETRY_UNAVAILABLE_S = 1.0
SEND_BATCH = 256


def _limit(value: int | None) -> int:
    return -1 if value is None else value


def _float(raw: bytes) -> float | None:
    return float(raw) if raw else None


class RedisQuotas:
    def __init__(self, url: str, outbox_path: str | os.PathLike = ":memory:", *,
                 lease_ttl: float = 10.0, prefix: str = "sg", timeout: float = 1.0):
        # One immediate retry reconnects a pooled socket that Redis closed (a restart);
        # more would only delay the 503 while Redis is down.
        self.redis = Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                    retry=Retry(NoBackoff(), 1))
        self.outbox = Outbox(outbox_path)
        self.lease_ttl = lease_ttl
        self.prefix = prefix
        self._begin = self.redis.register_script(BEGIN)
        self._tokens = self.redis.register_script(TOKENS)
        self._settle = self.redis.register_script(SETTLE)
        self._renew = self.redis.register_script(RENEW)
        self._leases: dict[str, tuple[Lease, int]] = {}  # live leases here: id -> (lease, tpm)
        self._headers: dict[str, dict[str, str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []

    def keys(self, tenant: str) -> dict[str, str]:
        tag = f"{{{self.prefix}:{tenant}}}"
        return {k: f"{tag}:{k}" for k in ("q", "leases", "held", "billed", "expired")}

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
        except (asyncio.TimeoutError, *UNREACHABLE) as exc:
            log.warning("quota outbox: %d settlements left for the next start (%s)",
                        len(self.outbox), exc.__class__.__name__)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.redis.aclose()
        self.outbox.close()

    # -- admission -------------------------------------------------------------------

    async def begin(self, tenant: Tenant) -> Lease:
        """Take a concurrency lease and one request in one round trip, or raise
        QuotaExceeded taking nothing; QuotaBackendUnavailable when Redis is unreachable."""
        lim, k = tenant.limits, self.keys(tenant.name)
        lease_id, tpm = uuid.uuid4().hex, _limit(lim.tokens_per_minute)
        try:
            await self._run(tenant, 0, self._begin, [k["q"], k["leases"], k["held"], k["billed"], k["expired"]],
                            [_limit(lim.requests_per_minute), tpm,
                             _limit(lim.max_concurrent), lease_id, int(self.lease_ttl * 1000)])
        except asyncio.CancelledError:
            # The script may have run and only its reply was lost (the client left): release
            # what it may have taken now rather than at the TTL. Settling a lease Redis never
            # took is a no-op. (A reply lost to a socket timeout waits for the TTL.)
            self._enqueue(Settlement(lease_id, tenant.name, 0, tpm))
            raise
        lease = Lease(self, tenant, 0, lease_id=lease_id)
        self._leases[lease_id] = (lease, tpm)
        return lease

    async def _reserve_more(self, lease: Lease, tokens: int) -> None:
        """`Lease.reserve_tokens`: tokens/min and the daily budget in one round trip."""
        tenant = lease._tenant
        lim, k = tenant.limits, self.keys(tenant.name)
        await self._run(tenant, tokens, self._tokens, [k["q"], k["leases"], k["held"], k["billed"]],
                        [_limit(lim.requests_per_minute), _limit(lim.tokens_per_minute),
                         _limit(lim.daily_tokens), tokens, lease.id])
        lease.reserved_tokens += tokens

    async def _run(self, tenant: Tenant, tokens: int, script, keys: list[str], args: list) -> None:
        """Run an admission script; its refusal becomes the embedded backend's QuotaExceeded."""
        try:
            ok, reason, retry, info, req, tok = await script(keys=keys, args=args)
        except UNREACHABLE as exc:
            raise QuotaBackendUnavailable(
                f"quota_backend_unavailable: the shared quota store (Redis) cannot be reached "
                f"({exc.__class__.__name__}); retry in {RETRY_UNAVAILABLE_S:.0f} s",
                RETRY_UNAVAILABLE_S) from None
        headers = self._headers[tenant.name] = _headers(tenant, _float(req), _float(tok))
        if ok:
            return
        if reason == b"lease_expired":
            raise QuotaBackendUnavailable(
                "quota_backend_unavailable: this replica could not renew the request's lease in "
                f"time; retry in {RETRY_UNAVAILABLE_S:.0f} s", RETRY_UNAVAILABLE_S)
        raise _refusal(tenant, reason.decode(), _float(retry), _float(info), tokens, headers)

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
        self._enqueue(Settlement(lease.id, lease.tenant, used_tokens, tpm))

    def _enqueue(self, settlement: Settlement) -> None:
        self.outbox.add(settlement)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _send_settlements(self) -> None:
        backoff = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                more = await self._send_batch()
                backoff = 0.05
            except UNREACHABLE as exc:
                log.warning("quota outbox: Redis unreachable (%s); %d settlements kept, retry "
                            "in %.2f s", exc.__class__.__name__, len(self.outbox), backoff)
                await asyncio.sleep(backoff)
                backoff, more = min(2 * backoff, 2.0), True
            if more:
                self._wake.set()

    async def _send_batch(self) -> bool:
        """Send the oldest pending settlements in one round trip; True if more wait."""
        batch = self.outbox.pending(SEND_BATCH)
        if not batch:
            return False
        calls = []
        for s in batch:
            k = self.keys(s.tenant)
            calls.append(([k["q"], k["leases"], k["held"], k["billed"], k["expired"]],
                          [s.lease_id, s.used, s.tpm]))
        await self._evalsha_many(self._settle, calls)
        self.outbox.remove([s.lease_id for s in batch])
        return len(batch) == SEND_BATCH

    async def flush(self) -> None:
        """Send every pending settlement now (the background sender does this by itself)."""
        while await self._send_batch():
            pass

    # -- heartbeat -------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            try:
                await self.renew()
            except UNREACHABLE as exc:
                log.warning("quota heartbeat: Redis unreachable (%s); leases expire after "
                            "%.1f s without renewal", exc.__class__.__name__, self.lease_ttl)

    async def renew(self) -> None:
        """Push the expiry of every live lease of this replica, one pipelined round trip."""
        by_tenant: dict[str, list[str]] = defaultdict(list)
        for lease_id, (lease, _) in list(self._leases.items()):
            by_tenant[lease.tenant].append(lease_id)
        if by_tenant:
            ttl_ms = int(self.lease_ttl * 1000)
            await self._evalsha_many(self._renew, [([self.keys(t)["leases"]], [ttl_ms, *ids])
                                                   for t, ids in by_tenant.items()])

    async def _evalsha_many(self, script, calls: list[tuple[list, list]]) -> list:
        """EVALSHA each call in one pipelined round trip; if Redis lost the script (a
        restart: NOSCRIPT), load it and send again (the scripts are idempotent)."""
        for _ in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) for r in results):
                break
            await self.redis.script_load(script.script)
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results


def _headers(tenant: Tenant, req: float | None, tok: float | None) -> dict[str, str]:
    """The embedded backend's x-ratelimit-* headers from the levels the script returned."""
    out: dict[str, str] = {}
    lim = tenant.limits
    for kind, cap, level in (("requests", lim.requests_per_minute, req),
                             ("tokens", lim.tokens_per_minute, tok)):
        if cap is not None and level is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(cap)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level + EPS)))
            out[f"x-ratelimit-reset-{kind}"] = format_duration((cap - level) * 60 / cap)
    return out


def _refusal(tenant: Tenant, reason: str, retry: float | None, info: float | None,
             tokens: int, headers: dict[str, str]) -> QuotaExceeded:
    """The embedded backend's QuotaExceeded for a refusal the script returned."""
    lim = tenant.limits
    if reason == "max_concurrent":
        msg = f"{info:.0f} requests already in flight (limit {lim.max_concurrent})"
        retry = CONCURRENCY_RETRY_S
    elif reason == "requests_per_minute":
        msg = f"the limit of {lim.requests_per_minute} requests per minute is used up"
    elif reason == "tokens_per_minute":
        left = (f"the limit is {lim.tokens_per_minute} per minute" if retry is None
                else f"{info:.0f} are left")
        msg = f"this request reserves {tokens} tokens but {left}"
    else:
        detail = (f"{info:.0f} of the daily budget of {lim.daily_tokens} are left "
                  "(resets at 00:00 UTC)" if retry is not None
                  else f"the whole daily budget is {lim.daily_tokens}")
        msg = f"this request reserves {tokens} tokens but {detail}"
    when = "it can never fit" if retry is None else f"retry in {retry:.1f} s"
    return QuotaExceeded(reason, f"{reason}: {msg}; {when}", retry, headers)
