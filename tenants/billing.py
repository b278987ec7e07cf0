"""Billing that fails closed (docs/PROTOCOL.md, "Settlement").

A settlement's usage record is written to the ledger at once if it can be without
waiting (the ledger's busy timeout is 0). If it cannot (the file is locked by another
process, the disk is full, an I/O error), the record is kept, appended to a spill file
beside the ledger (`<ledger>.unbilled.jsonl`, replayed at the next start), and retried on
a thread with backoff. Until every record of a tenant is written, that tenant is refused
new work, and the lease that produced it keeps its concurrency slot, its tokens per
minute and its daily hold: nothing is given back before it is recorded.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .ledger import Ledger

log = logging.getLogger("streamgate.billing")

BACKOFF_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


@dataclass
class Record:
    tenant: str
    tokens: int
    day: str
    lease_id: str


class Billing:
    def __init__(self, ledger: Ledger, on_written: Callable[[Record], None]):
        """`on_written(record)`: called (on the writing thread) once a record is in the
        ledger, to release what its lease held."""
        self.ledger = ledger
        self.on_written = on_written
        self.spill_path = None if ledger.path == ":memory:" else ledger.path + ".unbilled.jsonl"
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: list[Record] = []
        self._blocked: dict[str, int] = {}      # tenant -> records not yet written
        self._thread: threading.Thread | None = None
        self._stopped = False

    def blocked(self, tenant: str) -> int:
        """How many of `tenant`'s usage records are not written yet (0: it may be admitted)."""
        return self._blocked.get(tenant, 0)

    @property
    def unwritten(self) -> int:
        return len(self._pending)

    def record(self, tenant: str, tokens: int, lease_id: str) -> bool:
        """Write now if that needs no waiting: True. Otherwise keep, spill and retry the
        record off the caller's thread: False (the caller keeps its holds until
        `on_written`)."""
        rec = Record(tenant, tokens, self.ledger.today(), lease_id)
        if not self._blocked.get(tenant):
            try:
                self.ledger.add(tenant, tokens, rec.day)
                return True
            except sqlite3.Error as exc:
                log.error("billing: the ledger refused a usage record (%s: %s); tenant %r is refused "
                          "new work until it is written", type(exc).__name__, exc, tenant)
        self._keep(rec)
        return False

    def replay(self) -> list[Record]:
        """Records a previous run spilled and never wrote: kept again (written by the retry
        thread); returned so the owner can block their tenants."""
        if self.spill_path is None or not os.path.exists(self.spill_path):
            return []
        with open(self.spill_path, encoding="utf-8") as f:
            records = [Record(**json.loads(line)) for line in f if line.strip()]
        for rec in records:
            self._keep(rec, spill=False)
        return records

    def _keep(self, rec: Record, spill: bool = True) -> None:
        with self._lock:
            self._pending.append(rec)
            self._blocked[rec.tenant] = self._blocked.get(rec.tenant, 0) + 1
            if spill:
                self._spill_locked()
            if self._thread is None:
                self._thread = threading.Thread(target=self._retry, name="streamgate-billing", daemon=True)
                self._thread.start()
        self._wake.set()

    def _spill_locked(self) -> None:
        """Rewrite the spill file with what is pending (removed when nothing is)."""
        if self.spill_path is None:
            return
        try:
            if not self._pending:
                if os.path.exists(self.spill_path):
                    os.remove(self.spill_path)
                return
            tmp = self.spill_path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                for r in self._pending:
                    f.write(json.dumps(r.__dict__) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.spill_path)
        except OSError as exc:          # the disk is full too: the records stay in memory
            log.error("billing: cannot spill %d unwritten usage records (%s)", len(self._pending), exc)

    def _retry(self) -> None:
        conn = self.ledger.retry_connection()
        attempt = 0
        try:
            while not self._stopped:
                with self._lock:
                    batch = list(self._pending)
                    if not batch:
                        self._thread = None
                        return
                written = []
                for rec in batch:
                    try:
                        self.ledger.add(rec.tenant, rec.tokens, rec.day, conn=conn)
                    except sqlite3.Error:
                        break
                    written.append(rec)
                for rec in written:
                    self.on_written(rec)            # released only now that it is recorded
                with self._lock:
                    for rec in written:
                        self._pending.remove(rec)
                    self._spill_locked()            # the spill file first: then the tenant is let in
                    for rec in written:
                        self._blocked[rec.tenant] -= 1
                        if not self._blocked[rec.tenant]:
                            del self._blocked[rec.tenant]
                            log.warning("billing: tenant %r's usage is recorded again", rec.tenant)
                if len(written) < len(batch):
                    self._wake.wait(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
                    self._wake.clear()
                    attempt += 1
                else:
                    attempt = 0
        finally:
            if conn is not None:
                conn.close()
            with self._lock:
                if self._stopped:
                    self._thread = None

    def close(self) -> None:
        """Stop retrying; what is unwritten stays in the spill file for the next start."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
