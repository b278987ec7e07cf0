"""Counted places under caps: open WebSockets (unauthenticated, authenticated, per tenant)
and stats subscribers per tenant. Used from the event loop only."""

from __future__ import annotations

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
