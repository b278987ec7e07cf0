"""Proposals from a tenant's finished requests: the n-gram index of speculative.py over the
tokens (prompt and answer) of each tenant's most recent finished sequences, consulted when a
sequence's own tokens propose nothing.

Why: agents resend what they sent before (a retried call, the same tool output, a document
edited again), and a greedy answer to the same context repeats. A sequence's own history
proposes only what its prompt and answer already hold; the tenant's history proposes what the
model wrote for it last time. vLLM's suffix decoding keeps a global tree of earlier answers,
and llama.cpp's `ngram-mod` a hash pool "shared across all server slots, so different requests
can benefit from each other"; here the history is per tenant: how fast a draft is accepted
tells its sender whether text like its own was seen, so a shared pool would let one tenant
probe another's traffic by timing. Sequences without a tenant share one history (in-process
use, where the process is one tenant).

Bounded: each tenant keeps `max_tokens` tokens of its newest finished sequences; a sequence
that pushes the total past it evicts the oldest, and their n-grams leave the index with them
(unless a newer sequence holds the same n-gram). Plain ints; never imports torch.
"""

from __future__ import annotations

from collections import OrderedDict


def grams(tokens: list[int], lo: int, hi: int, start: int = 0):
    """(n-gram, index of its last token) for every n-gram (n in [lo, hi]) ending at an index in
    [start, len - 1): those some token follows (one ending at the last token proposes nothing)."""
    for i in range(start, len(tokens) - 1):
        for n in range(lo, min(hi, i + 1) + 1):
            yield tuple(tokens[i - n + 1:i + 1]), i


class _Tenant:
    __slots__ = ("entries", "index", "tokens", "next_id")

    def __init__(self):
        self.entries: OrderedDict[int, list[int]] = OrderedDict()     # id -> tokens, oldest first
        self.index: dict[tuple[int, ...], tuple[int, int]] = {}      # n-gram -> (id, its last token's index)
        self.tokens = 0
        self.next_id = 0


class NgramHistory:
    def __init__(self, max_tokens: int, lo: int, hi: int):
        self.max_tokens, self.lo, self.hi = max_tokens, lo, hi
        self.tenants: dict[str, _Tenant] = {}

    def add(self, tenant: str | None, tokens: list[int]) -> None:
        """A finished sequence's tokens join its tenant's history (a sequence longer than the
        whole history is kept by its newest `max_tokens` tokens)."""
        tokens = list(tokens[-self.max_tokens:])
        if len(tokens) <= self.lo:
            return
        t = self.tenants.setdefault(tenant or "", _Tenant())
        while t.entries and t.tokens + len(tokens) > self.max_tokens:
            self._evict(t)
        sid, t.next_id = t.next_id, t.next_id + 1
        t.entries[sid] = tokens
        t.tokens += len(tokens)
        for key, i in grams(tokens, self.lo, self.hi):
            t.index[key] = (sid, i)

    def _evict(self, t: _Tenant) -> None:
        sid, tokens = t.entries.popitem(last=False)
        t.tokens -= len(tokens)
        for key, _ in grams(tokens, self.lo, self.hi):
            if t.index.get(key, (None,))[0] == sid:
                del t.index[key]

    def propose(self, tenant: str | None, tokens: list[int], k: int, longer_than: int = 0) -> list[int]:
        """Up to `k` tokens that followed the newest occurrence, in the tenant's history, of the
        longest suffix of `tokens` (n from hi down to lo, and above `longer_than`) found there;
        [] if none is."""
        t = self.tenants.get(tenant or "")
        if t is None or k <= 0:
            return []
        for n in range(min(self.hi, len(tokens)), max(self.lo, longer_than + 1) - 1, -1):
            hit = t.index.get(tuple(tokens[len(tokens) - n:]))
            if hit is not None:
                sid, at = hit
                return t.entries[sid][at + 1:at + 1 + k]
        return []

    def size(self, tenant: str | None) -> tuple[int, int]:
        """(tokens kept, n-grams indexed) for `tenant`."""
        t = self.tenants.get(tenant or "")
        return (0, 0) if t is None else (t.tokens, len(t.index))
