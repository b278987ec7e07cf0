"""The Redis backend's settlement sender (mixed into `RedisQuotas`): settlements wait in
the local outbox (or, when the outbox cannot be written, in memory, their tenant refused
meanwhile) and are sent in pipelined batches with the waiting trims, retried with backoff
whatever Redis answers. SETTLE ignores a lease id it has settled, so sending twice is
harmless."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

from redis.exceptions import RedisError

log = logging.getLogger("tenants.redis_quota")

FAILED = (RedisError, OSError)      # unreachable, or refused (OOM, READONLY, a script error)
SEND_BATCH = 256


class SettlementSender:
    async def _send_settlements(self) -> None:
        """Runs until stopped, whatever Redis answers: a failure (unreachable, OOM, a
        read-only replica, a script error) keeps the settlements in the outbox and retries
        with backoff; each kind of failure is logged once until a send succeeds again."""
        backoff, logged = 0.05, set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                more = await self._send_batch()
            except (*FAILED, sqlite3.Error) as exc:
                if exc.__class__ not in logged:     # ConnectionError, OutOfMemoryError, ReadOnlyError, ...
                    logged.add(exc.__class__)
                    log.warning("quota outbox: Redis failed (%s: %s); %d settlements kept, retrying "
                                "with backoff up to 2 s", exc.__class__.__name__, exc, len(self.outbox))
                await asyncio.sleep(backoff)
                backoff, more = min(2 * backoff, 2.0), True
            else:
                if logged:
                    log.warning("quota outbox: Redis accepts settlements again")
                backoff, logged = 0.05, set()
            if more:
                self._wake.set()

    async def _send_batch(self) -> bool:
        """Send the waiting trims and the oldest pending settlements in one round trip;
        True if more wait. A settlement Redis refused stays in the outbox (the others go):
        its error is raised after the round trip. A trim is sent once: if it fails, the
        settlement gives the excess back instead."""
        trims, self._trims = self._trims, {}
        unwritten = list(self._unwritten.values())
        batch = unwritten + self.outbox.pending(SEND_BATCH)
        if not batch and not trims:
            return False
        calls = []
        for t in trims.values():
            k = self.keys(t.tenant)
            calls.append((self._trim_script, [k["q"], k["held"]], [t.lease_id, t.used, t.tpm]))
        for s in batch:
            k = self.keys(s.tenant)
            calls.append((self._settle, [k["q"], k["leases"], k["held"], k["billed"], k["expired"], k["settled"]],
                          [s.lease_id, s.used, s.tpm]))
        results = await self._evalsha_many(calls)
        settled = results[len(trims):]
        for s, r in zip(unwritten, settled):
            if not isinstance(r, Exception):
                del self._unwritten[s.lease_id]
                self._unwritten_by_tenant[s.tenant] -= 1
        self.outbox.remove([s.lease_id for s, r in zip(batch, settled) if not isinstance(r, Exception)])
        for r in results:
            if isinstance(r, Exception):
                raise r
        return len(batch) >= SEND_BATCH

    async def flush(self) -> None:
        """Send every pending settlement now (the background sender does this by itself)."""
        while await self._send_batch():
            pass
