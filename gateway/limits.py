"""Counted places under caps (open WebSockets: unauthenticated, per address, authenticated,
per tenant; stats subscribers per tenant) and a per-address rate for keyless WebSocket
upgrades. Used from the event loop only."""

from __future__ import annotations

import time
from collections import Counter


class Slots:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def take(self, key: str, cap: int) -> bool:
        """Take a place under `key` if fewer than `cap` are taken; False otherwise."""
        if self.counts[key] >= cap:
            return False
        self.counts[key] += 1
        return True

    def give(self, key: str) -> None:
        self.counts[key] -= 1
        if self.counts[key] <= 0:
            del self.counts[key]

    def __getitem__(self, key: str) -> int:
        return self.counts.get(key, 0)


class AddressRate:
    """A token bucket per client address: `burst` at once, then `rate` per second. Once
    more than `max_addresses` are tracked, the full buckets are forgotten (a bucket is
    full again `burst / rate` seconds after its last use), so the table holds only the
    addresses seen lately; the next clean-up waits until the table has doubled, so the
    sweeps cost O(1) per call however many addresses a client uses."""

    def __init__(self, rate: float, burst: int, *, clock=time.monotonic, max_addresses: int = 4096):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.max_addresses = self.sweep_at = max_addresses
        self.buckets: dict[str, tuple[float, float]] = {}      # address -> (tokens, at)

    def admit(self, address: str) -> bool:
        now = self.clock()
        tokens, at = self.buckets.get(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1:
            self.buckets[address] = (tokens, now)
            return False
        self.buckets[address] = (tokens - 1, now)
        if len(self.buckets) > self.sweep_at:
            self._forget_full(now)
        return True

    def _forget_full(self, now: float) -> None:
        full = [a for a, (tokens, at) in self.buckets.items() if tokens + (now - at) * self.rate >= self.burst]
        for address in full:
            del self.buckets[address]
        self.sweep_at = max(self.max_addresses, 2 * len(self.buckets))
