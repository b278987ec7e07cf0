"""Issue 25 item 8 and 9 on a real redis-server: BEGIN is idempotent by lease id (a
re-sent BEGIN takes nothing twice), a settlement that overtakes its own BEGIN leaves no
lease behind, and a settlement the local outbox cannot write (another process holds it
locked) is kept in memory, sent to Redis, and refuses its tenant until Redis has it."""

from __future__ import annotations

import asyncio

import pytest

from tenants import Limits, QuotaBackendUnavailable, Tenant, admit
from tenants.redis_quota import RedisQuotas
from tenants.redis_scripts import limit_arg
from tests.test_ledger_fails_closed import Locked

from .redis_server import redis_server  # noqa: F401  (fixture)

ACME = Tenant("acme", ("0" * 64,), limits=Limits(max_concurrent=2, tokens_per_minute=1000, daily_tokens=10_000))


@pytest.fixture
async def backend(redis_server, tmp_path):
    b = RedisQuotas(redis_server.url, tmp_path / "outbox.sqlite", lease_ttl=10.0, timeout=0.5)
    await b.start()
    yield b
    await b.stop(flush_timeout=0.5)


async def begin_script(b: RedisQuotas, lease_id: str, estimate: int):
    lim, k = ACME.limits, b.keys(ACME.name)
    return await b._begin(keys=[k["q"], k["leases"], k["held"], k["billed"], k["expired"], k["settled"]],
                          args=[limit_arg(lim.requests_per_minute), limit_arg(lim.tokens_per_minute),
                                limit_arg(lim.max_concurrent), limit_arg(lim.daily_tokens), lease_id, 10_000,
                                estimate, 2.0])


async def test_begin_sent_twice_takes_its_lease_once(backend):
    """What redis-py's retry did after a slow reply: the same BEGIN again. The second
    answers what the first took and takes nothing more."""
    first = await begin_script(backend, "lease-1", 100)
    again = await begin_script(backend, "lease-1", 100)
    assert first[0] == again[0] == 1 and first[6] == again[6] == 100
    snap = await backend.snapshot(ACME)
    assert snap["in_flight"] == 1 and snap["daily_reserved"] == 100
    assert (await backend.redis.hget(backend.keys("acme")["q"], "reserved")) == b"100"


async def test_a_settlement_that_overtakes_its_begin_leaves_nothing_held(backend):
    """A cancelled BEGIN's settlement can reach Redis first (another pooled connection);
    the late BEGIN then takes nothing instead of holding a slot for a whole TTL."""
    k = backend.keys("acme")
    settled = await backend._settle(keys=[k["q"], k["leases"], k["held"], k["billed"], k["expired"], k["settled"]],
                                    args=["lease-2", 0, 1000])
    assert settled == 0
    late = await begin_script(backend, "lease-2", 100)
    assert late[0] == 0
    assert await backend.snapshot(ACME) == {"in_flight": 0, "daily_reserved": 0, "daily_used": 0}


async def test_an_unwritable_outbox_keeps_the_settlement_and_refuses_the_tenant(redis_server, tmp_path):
    path = tmp_path / "outbox.sqlite"
    b = RedisQuotas(redis_server.url, path, lease_ttl=10.0, timeout=0.5)
    lock = Locked(path)
    try:
        lease = await admit(b, ACME, 100)
        lease.settle(60)
        with pytest.raises(QuotaBackendUnavailable):
            await b.begin(ACME)                 # not sent yet (the sender is not started)
        await b.start()                         # it sends from memory
        for _ in range(500):
            if not b._unwritten:
                break
            await asyncio.sleep(0.02)
        assert not b._unwritten
        assert (await b.snapshot(ACME))["daily_used"] == 60
        (await admit(b, ACME, 10)).settle(10)
    finally:
        lock.release()
    await b.flush()
    assert await b.snapshot(ACME) == {"in_flight": 0, "daily_reserved": 0, "daily_used": 70}
    await b.stop()
