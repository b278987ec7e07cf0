"""Settlements waiting to reach Redis, in a local SQLite file, so no billed token is lost.

`Lease.settle` is sync and runs in `finally` blocks of cancelled tasks, so it cannot await
Redis: it writes the settlement here (one small transaction) and a background task sends
it. A row is deleted only after Redis accepted it; a replica that restarts sends what it
left. Sending twice is harmless: the settle script ignores a lease id it has settled.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS settlements (
    lease_id TEXT PRIMARY KEY,
    tenant   TEXT NOT NULL,
    used     INTEGER NOT NULL,
    tpm      INTEGER NOT NULL,     -- tokens-per-minute limit at admission, -1 = unlimited
    at       REAL NOT NULL         -- wall-clock time of the settlement (for logs)
)
"""


@dataclass(frozen=True)
class Settlement:
    lease_id: str
    tenant: str
    used: int
    tpm: int


class Outbox:
    def __init__(self, path: str | os.PathLike = ":memory:"):
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(path), check_same_thread=False, timeout=5.0)
        with self._lock, self._conn:
            # WAL + NORMAL: a commit survives the process being killed (kill -9), as the
            # embedded ledger does; only a power loss can drop the last commits.
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(SCHEMA)
        # After set-up nothing waits for a lock (the event loop calls this): a locked file
        # is an immediate sqlite3.Error, and the caller keeps the settlement in memory.
        self._conn.execute("PRAGMA busy_timeout=0")

    def add(self, s: Settlement) -> None:
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT OR IGNORE INTO settlements VALUES (?, ?, ?, ?, ?)",
                (s.lease_id, s.tenant, s.used, s.tpm, time.time()))

    def pending(self, limit: int) -> list[Settlement]:
        """The oldest settlements not yet accepted by Redis."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT lease_id, tenant, used, tpm FROM settlements ORDER BY at LIMIT ?",
                (limit,)).fetchall()
        return [Settlement(*row) for row in rows]

    def remove(self, lease_ids: list[str]) -> None:
        with self._lock, self._conn:
            self._conn.executemany("DELETE FROM settlements WHERE lease_id = ?",
                                   [(i,) for i in lease_ids])

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM settlements").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
