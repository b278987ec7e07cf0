"""Daily token usage in SQLite: accumulation, persistence and the UTC day boundary."""

from __future__ import annotations

import calendar
import threading

import pytest

from tenants import Ledger

# 2024-05-01 23:59:00 UTC
LATE = calendar.timegm((2024, 5, 1, 23, 59, 0))


class WallClock:
    def __init__(self, t: float = LATE):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_add_accumulates_per_tenant():
    """Usage adds up per tenant and starts at zero."""
    led = Ledger()
    assert led.used_today("acme") == 0
    led.add("acme", 10)
    led.add("acme", 5)
    led.add("beta", 7)
    assert led.used_today("acme") == 15 and led.used_today("beta") == 7


def test_negative_add_rejected():
    """Adding negative usage is a programming error."""
    with pytest.raises(ValueError):
        Ledger().add("acme", -1)


def test_persists_across_reopen_and_creates_dirs(tmp_path):
    """Usage written to a file (in a new directory) is there after reopening it."""
    path = tmp_path / "state" / "usage.sqlite"
    clock = WallClock()
    led = Ledger(path, clock=clock)
    led.add("acme", 42)
    led.close()
    again = Ledger(path, clock=clock)
    assert again.used_today("acme") == 42
    again.close()


def test_resets_at_next_utc_day():
    """A new UTC date starts from zero; the old day's row is kept apart."""
    clock = WallClock()
    led = Ledger(clock=clock)
    led.add("acme", 100)
    assert led.today() == "2024-05-01"
    assert led.seconds_to_next_day() == pytest.approx(60.0)
    clock.t += 60
    assert led.today() == "2024-05-02" and led.used_today("acme") == 0
    assert led.seconds_to_next_day() == pytest.approx(86400.0)
    clock.t -= 1
    assert led.used_today("acme") == 100


def test_uses_wal_mode(tmp_path):
    """A file ledger runs in WAL mode."""
    led = Ledger(tmp_path / "u.sqlite")
    assert led._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    led.close()


def test_concurrent_adds_from_threads_are_all_counted(tmp_path):
    """Adds from several threads are serialised and none is lost."""
    led = Ledger(tmp_path / "u.sqlite")

    def work():
        for _ in range(50):
            led.add("acme", 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert led.used_today("acme") == 200
    led.close()
