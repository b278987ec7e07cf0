"""Billing fails closed (issue 25, item 9), on a real SQLite file that another process
holds locked (`BEGIN IMMEDIATE`): a settlement that cannot be written keeps its slot and
tokens, is spilled and retried off the caller's thread, its tenant is refused new work
until it is written, and it is billed exactly once, also across a restart."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tenants import Ledger, QuotaBackendUnavailable, QuotaManager, Tenant, admit
from tests.fake_engine import FloodEngine
from tests.idle import assert_idle
from tests.live import KEYS, serve, wait_until

HOLD = """
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()
"""


class Locked:
    """Another process holding the ledger's write lock until `release()`."""

    def __init__(self, path):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "locked"

    def release(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def tenant(name: str) -> Tenant:
    return Tenant(name=name, key_hashes=())


async def test_an_unwritable_settlement_holds_its_slot_and_blocks_its_tenant(tmp_path):
    path = tmp_path / "usage.sqlite3"
    qm = QuotaManager(Ledger(path))
    acme, beta = tenant("acme"), tenant("beta")
    lock = Locked(path)
    try:
        lease = await admit(qm, acme, 100)
        assert lease.settle(70)                 # the write does not wait for the lock (busy timeout 0)
        assert qm.in_flight("acme") == 1 and qm.billing.blocked("acme") == 1
        assert (tmp_path / "usage.sqlite3.unbilled.jsonl").exists()
        with pytest.raises(QuotaBackendUnavailable):
            await qm.begin(acme)
        (await admit(qm, beta, 10)).settle(0)    # 0 tokens: nothing to write, beta is not blocked
        assert qm.in_flight("beta") == 0
    finally:
        lock.release()
    assert wait_until(lambda: qm.in_flight("acme") == 0 and not qm.billing.blocked("acme"))
    assert qm.ledger.used_today("acme") == 70
    assert not (tmp_path / "usage.sqlite3.unbilled.jsonl").exists()
    (await admit(qm, acme, 10)).settle(10)
    assert qm.ledger.used_today("acme") == 80
    await qm.stop()


async def test_spilled_usage_is_written_once_after_a_restart(tmp_path):
    path = tmp_path / "usage.sqlite3"
    qm = QuotaManager(Ledger(path))
    lock = Locked(path)
    try:
        (await admit(qm, tenant("acme"), 50)).settle(40)
        await qm.stop()                          # "crash" with the record unwritten
        again = QuotaManager(Ledger(path))       # the next start replays the spill file
        with pytest.raises(QuotaBackendUnavailable):
            await again.begin(tenant("acme"))
    finally:
        lock.release()
    assert wait_until(lambda: not again.billing.blocked("acme"))
    assert again.ledger.used_today("acme") == 40
    await again.stop()


def test_a_locked_ledger_refuses_the_tenant_until_its_usage_is_written(tmp_path):
    """Live: with the ledger locked by another process, a request still completes (the
    event loop never waits on the lock), its tenant's next one is a 503 until the usage is
    written, and once the lock goes the tokens are in the ledger and everything is idle."""
    path = tmp_path / "usage.sqlite3"
    with serve("fake", tmp_path, engine=FloodEngine(chunk=1), ledger_path=path) as live:
        def post(key=KEYS["acme"]):
            return httpx.post(f"{live.url}/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        lock = Locked(path)
        try:
            assert post().status_code == 200
            r = post()
            assert r.status_code == 503 and r.json()["error"]["code"] == "quota_backend_unavailable", r.text
            assert httpx.get(f"{live.url}/health", timeout=30).status_code == 200
            assert live.gateway.ledger.used_today("acme") == 0
        finally:
            lock.release()
        assert wait_until(lambda: live.gateway.ledger.used_today("acme") == 2 + 3)     # "hi" + 3 tokens
        assert_idle(live)
        assert post().status_code == 200
        assert_idle(live)


def test_the_wal_is_checkpointed_off_the_writing_thread(tmp_path):
    """Writes never run the WAL checkpoint themselves (the step that fsyncs); a thread
    does, every CHECKPOINT_EVERY writes, and the usage is all there after it."""
    import os

    from tenants.ledger import CHECKPOINT_EVERY

    led = Ledger(tmp_path / "usage.sqlite3")
    wal = tmp_path / "usage.sqlite3-wal"
    for _ in range(CHECKPOINT_EVERY):       # the last one starts the checkpoint thread
        led.add("acme", 1)
    assert wait_until(lambda: not led._checkpointing.locked())
    size = os.path.getsize(wal)
    for _ in range(50):                     # after a checkpoint the WAL is reused from its start
        led.add("acme", 1)
    assert os.path.getsize(wal) == size
    assert led.used_today("acme") == CHECKPOINT_EVERY + 50
    led.close()
