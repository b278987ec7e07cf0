"""Daily token usage per tenant in SQLite, so daily budgets survive restarts.

The day is the UTC date of the injected wall clock. Each call is one tiny indexed
statement, so it runs synchronously on the caller's thread, but it never waits for a lock:
the connection's busy timeout is 0, so a file another process holds locked (or a full
disk, an I/O error) raises `sqlite3.Error` at once instead of stalling the gateway's event
loop for sqlite3's default 5 s. `tenants.billing` retries failed writes on a thread, on
`retry_connection()`, which may wait. The WAL checkpoint (the one step of a WAL commit
that fsyncs) runs on a thread too, every CHECKPOINT_EVERY writes.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

DAY = 86400.0
CHECKPOINT_EVERY = 256          # ledger writes between two checkpoints

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL,
    day    TEXT NOT NULL,           -- UTC date, YYYY-MM-DD
    tokens INTEGER NOT NULL,
    PRIMARY KEY (tenant, day)
)
"""


class Ledger:
    def __init__(self, path: str | os.PathLike = ":memory:",
                 clock: Callable[[], float] = time.time):
        self.clock = clock
        self.path = str(path)
        self._lock = threading.Lock()
        if self.path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Set-up (before the server starts) may wait for a lock; afterwards nothing does.
        self._conn = sqlite3.connect(self.path, check_same_thread=False, timeout=5.0)
        with self._lock, self._conn:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(SCHEMA)
        self._conn.execute("PRAGMA busy_timeout=0")
        # WAL commits (synchronous=NORMAL) do not fsync, but the automatic checkpoint
        # that every ~1000 pages runs inside a commit does: checkpoints run on a thread.
        self._writes = 0
        self._checkpointing = threading.Lock()
        if self.path != ":memory:":
            self._conn.execute("PRAGMA wal_autocheckpoint=0")

    def today(self) -> str:
        """The current UTC date as YYYY-MM-DD."""
        return time.strftime("%Y-%m-%d", time.gmtime(self.clock()))

    def seconds_to_next_day(self) -> float:
        """Seconds from now until the next UTC midnight (when daily budgets reset)."""
        now = self.clock()
        return (now // DAY + 1) * DAY - now

    def used_today(self, tenant: str) -> int:
        with self._lock:
            row = self._conn.execute(
                "SELECT tokens FROM usage WHERE tenant = ? AND day = ?",
                (tenant, self.today())).fetchone()
        return row[0] if row else 0

    def add(self, tenant: str, tokens: int, day: str | None = None, conn: sqlite3.Connection | None = None) -> None:
        """Add `tokens` to (tenant, day or today) in one transaction; raises sqlite3.Error
        (at once on the default connection) if it cannot be written."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0 (got {tokens})")
        if tokens == 0:
            return
        sql = ("INSERT INTO usage (tenant, day, tokens) VALUES (?, ?, ?) "
               "ON CONFLICT (tenant, day) DO UPDATE SET tokens = tokens + excluded.tokens")
        if conn is not None:
            with conn:
                conn.execute(sql, (tenant, day or self.today(), tokens))
            return
        with self._lock, self._conn:
            self._conn.execute(sql, (tenant, day or self.today(), tokens))
        self._writes += 1
        if self._writes % CHECKPOINT_EVERY == 0:
            self.checkpoint_soon()

    def checkpoint_soon(self) -> None:
        """Copy the WAL back into the database on a thread of its own (PASSIVE: it never
        blocks a writer); one at a time."""
        if self.path == ":memory:" or not self._checkpointing.acquire(blocking=False):
            return

        def run() -> None:
            try:
                conn = sqlite3.connect(self.path, timeout=5.0)
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                finally:
                    conn.close()
            except sqlite3.Error:
                pass                    # the next one tries again
            finally:
                self._checkpointing.release()

        threading.Thread(target=run, name="streamgate-ledger-checkpoint", daemon=True).start()

    def retry_connection(self, timeout_s: float = 2.0) -> sqlite3.Connection | None:
        """A connection of its own that waits up to `timeout_s` for a lock, for a thread
        retrying writes (None for an in-memory ledger: it has only its one connection)."""
        if self.path == ":memory:":
            return None
        return sqlite3.connect(self.path, check_same_thread=False, timeout=timeout_s)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
