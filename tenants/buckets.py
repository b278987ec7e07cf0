"""Token buckets refilled continuously (requests and tokens per minute, embedded backend)
and the Go-style durations of the x-ratelimit-reset-* headers (both backends)."""

from __future__ import annotations

import math

EPS = 1e-9  # float slack so that exactly-refilled buckets count as full


class TokenBucket:
    """Holds up to `capacity` tokens, refilled continuously at `rate` per second."""

    def __init__(self, capacity: int, rate: float, now: float, tokens: float | None = None):
        self.capacity = capacity
        self.rate = rate
        self.tokens = float(capacity) if tokens is None else tokens
        self.last = now

    def available(self, now: float) -> float:
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now
        return self.tokens

    def wait_for(self, n: float, now: float) -> float | None:
        """Seconds until `n` tokens are available; None if n exceeds the capacity."""
        if n > self.capacity:
            return None
        return max(0.0, (n - self.available(now)) / self.rate)

    def time_to_full(self, now: float) -> float:
        return (self.capacity - self.available(now)) / self.rate


def resize(bucket: TokenBucket | None, per_minute: int | None, now: float) -> TokenBucket | None:
    if per_minute is None:
        return None
    if bucket is None:
        return TokenBucket(per_minute, per_minute / 60.0, now)
    if bucket.capacity != per_minute:
        return TokenBucket(per_minute, per_minute / 60.0, now,
                           tokens=min(per_minute, bucket.available(now)))
    return bucket


def format_duration(seconds: float) -> str:
    """Go-style duration as OpenAI sends it: '250ms', '1s', '1.5s', '6m0s', '1h2m3s'."""
    ms = math.ceil(round(max(0.0, seconds) * 1000, 6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return out + f"{secs}s"
