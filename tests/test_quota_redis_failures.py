"""Redis quota backend under failure, with real processes: a replica killed with SIGKILL
frees its leases within the TTL, Redis restarts keep the day's usage (AOF), Redis down
fails admission closed and service resumes when it returns, and settlements made while
it was down are billed exactly once, even across a replica restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
from tenants import Limits, QuotaBackendUnavailable, QuotaExceeded, Tenant, admit
from tenants.outbox import Settlement
from tenants.redis_quota import RedisQuotas

from bench.redis_server import free_port

from .redis_server import redis_server  # noqa: F401  (fixture)
from .test_quota_redis import drain, try_admit

ROOT = Path(__file__).resolve().parent.parent
TTL = 1.0


def tenant(**limits) -> Tenant:
    return Tenant(name="acme", key_hashes=("0" * 64,), limits=Limits(**limits))


@pytest.fixture
async def backend(redis_server, tmp_path):
    b = RedisQuotas(redis_server.url, tmp_path / "outbox.sqlite", lease_ttl=TTL, timeout=0.5)
    await b.start()
    yield b
    await b.stop(flush_timeout=0.5)


HOLDER = textwrap.dedent("""
    import asyncio, sys
    from tenants import Limits, Tenant, admit
    from tenants.redis_quota import RedisQuotas

    async def main():
        b = RedisQuotas(sys.argv[1], lease_ttl=float(sys.argv[2]))
        await b.start()
        await admit(b, Tenant("acme", ("0" * 64,), limits=Limits(max_concurrent=1)), 10)
        print("held", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def test_killed_replica_frees_its_lease_within_the_ttl(redis_server, backend):
    """A replica process holding the only slot keeps it past the TTL while its heartbeat
    runs; after SIGKILL the slot is free again within the TTL."""
    t = tenant(max_concurrent=1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, redis_server.url, str(TTL)],
                              stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        await asyncio.sleep(2.5 * TTL)  # several TTLs: only the heartbeat keeps it alive
        assert (await try_admit(backend, t, 10)).reason == "max_concurrent"
        holder.send_signal(signal.SIGKILL)
        holder.wait(5)
        killed = time.monotonic()
        while isinstance(lease := await try_admit(backend, t, 10), QuotaExceeded):
            assert time.monotonic() - killed < TTL + 0.5, "the dead replica's lease outlived its TTL"
            await asyncio.sleep(0.05)
        snap = await backend.snapshot(t)
        assert snap["in_flight"] == 1 and snap["daily_reserved"] == 10  # only the new lease
        lease.settle(0)
    finally:
        holder.kill()
        holder.wait(5)


async def test_redis_restart_with_aof_keeps_the_days_usage(redis_server, backend):
    """Usage billed before Redis is killed (SIGKILL) is still there after it restarts, and
    the daily budget still counts it."""
    t = tenant(daily_tokens=400)
    (await admit(backend, t, 300)).settle(300)
    await drain(backend)
    redis_server.stop(signal.SIGKILL)
    redis_server.start()
    assert (await backend.snapshot(t))["daily_used"] == 300
    refused = await try_admit(backend, t, 200)
    assert refused.reason == "daily_tokens" and "100 of the daily budget" in str(refused)


async def test_redis_down_fails_closed_and_resumes(redis_server, backend):
    """With Redis stopped, admission raises QuotaBackendUnavailable promptly (with a
    retry_after); once Redis is back the same backend admits again, no restart."""
    t = tenant(requests_per_minute=100)
    redis_server.stop()
    began = time.monotonic()
    with pytest.raises(QuotaBackendUnavailable) as exc:
        await admit(backend, t, 1)
    assert time.monotonic() - began < 2.0
    assert exc.value.retry_after > 0 and "quota_backend_unavailable" in str(exc.value)
    redis_server.start()
    lease = await admit(backend, t, 1)
    lease.settle(1)
    await drain(backend)
    assert (await backend.snapshot(t))["daily_used"] == 1


async def test_settlements_while_down_are_billed_exactly_once(redis_server, backend, tmp_path):
    """Settlements made while Redis is down are kept in the outbox and billed once when it
    returns; so are those a stopped replica left behind, replayed by its next start; a
    settlement sent twice is billed once."""
    t = tenant(daily_tokens=10_000, max_concurrent=10)
    leases = [await admit(backend, t, 100) for _ in range(3)]
    redis_server.stop()
    assert [lease.settle(u) for lease, u in zip(leases, (10, 20, 30))] == [True, True, True]
    assert leases[0].settle(99) is False
    await asyncio.sleep(0.3)  # the sender tries, fails and keeps them
    assert len(backend.outbox) == 3
    redis_server.start()
    await drain(backend)
    snap = await backend.snapshot(t)
    assert snap["daily_used"] == 60 and snap["daily_reserved"] == 0 and snap["in_flight"] == 0

    # A replica stopped while Redis is down keeps its settlements for its next start.
    path = tmp_path / "replica2.sqlite"
    first = RedisQuotas(redis_server.url, path, lease_ttl=TTL, timeout=0.5)
    await first.start()
    lease = await admit(first, t, 100)
    redis_server.stop()
    lease.settle(40)
    await first.stop(flush_timeout=0.3)
    redis_server.start()
    again = RedisQuotas(redis_server.url, path, lease_ttl=TTL)
    await again.start()
    try:
        await drain(again)
        assert (await again.snapshot(t))["daily_used"] == 100
        again.outbox.add(Settlement(lease.id, "acme", 40, -1))  # sent a second time
        await again.flush()
        assert (await again.snapshot(t))["daily_used"] == 100
    finally:
        await again.stop()


async def test_a_late_settlement_of_an_expired_lease_is_billed_once(redis_server, backend, tmp_path):
    """A lease whose heartbeat stopped is freed within the TTL; its settlement, arriving
    later (replayed from the outbox), is still billed, and only once."""
    t = tenant(max_concurrent=1, daily_tokens=10_000)
    stalled = RedisQuotas(redis_server.url, tmp_path / "stalled.sqlite", lease_ttl=TTL)
    lease = await admit(stalled, t, 100)  # never started: no heartbeat, no sender
    assert (await try_admit(backend, t, 100)).reason == "max_concurrent"
    await asyncio.sleep(TTL + 0.1)
    (await admit(backend, t, 100)).settle(30)  # frees the expired lease, then bills 30
    lease.settle(70)
    await stalled.start()
    try:
        await drain(backend, stalled)
        assert (await backend.snapshot(t)) == {"in_flight": 0, "daily_reserved": 0, "daily_used": 100}
        stalled.outbox.add(Settlement(lease.id, "acme", 70, -1))  # sent a second time
        await stalled.flush()
        assert (await backend.snapshot(t))["daily_used"] == 100
    finally:
        await stalled.stop()




async def test_settlements_outlast_a_redis_that_refuses_writes(redis_server, backend, caplog):
    """Redis refusing writes (made a read-only replica of a master that is not there) fails
    admission closed and does not stop the settlement sender: settlements wait in the
    outbox, the failure is logged once, and they are billed once Redis accepts writes
    again, without a restart."""
    t = tenant(daily_tokens=10_000, max_concurrent=10)
    leases = [await admit(backend, t, 100) for _ in range(2)]
    admin = redis.Redis.from_url(redis_server.url)
    admin.replicaof("127.0.0.1", free_port())           # keeps its data while it cannot sync
    try:
        with pytest.raises(QuotaBackendUnavailable) as exc:
            await admit(backend, t, 1)
        assert "ReadOnlyError" in str(exc.value)
        leases[0].settle(30)
        await asyncio.sleep(0.5)                        # several failed sends, with backoff
        leases[1].settle(50)
        await asyncio.sleep(0.5)
        assert len(backend.outbox) == 2
    finally:
        admin.replicaof("NO", "ONE")
        admin.close()
    deadline = time.monotonic() + 5                     # the backoff is at most 2 s
    while len(backend.outbox):
        assert time.monotonic() < deadline, "the sender stopped sending"
        await asyncio.sleep(0.05)
    assert (await backend.snapshot(t)) == {"in_flight": 0, "daily_reserved": 0, "daily_used": 80}
    sender = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quota outbox: Redis failed")]
    assert len(sender) == 1 and "ReadOnlyError" in sender[0]
