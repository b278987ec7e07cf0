"""Daily token usage per tenant in SQLite, so daily budgets survive restarts.

The day is the UTC date of the injected wall clock. Each call is one tiny indexed
statement, so it runs synchronously (the gateway calls it from its event-loop thread).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

DAY = 86400.0

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
        self._lock = threading.Lock()
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), check_same_thread=False)
        with self._lock, self._conn:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(SCHEMA)

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

    def add(self, tenant: str, tokens: int) -> None:
        """Add `tokens` to (tenant, today) in one transaction."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0 (got {tokens})")
        if tokens == 0:
            return
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT INTO usage (tenant, day, tokens) VALUES (?, ?, ?) "
                "ON CONFLICT (tenant, day) DO UPDATE SET tokens = tokens + excluded.tokens",
                (tenant, self.today(), tokens))

    def close(self) -> None:
        with self._lock:
            self._conn.close()
