"""How many threads a small step runs on, chosen by measuring it (CPU only).

A decode step of a few rows is bound by reading the weights and by ~150 parallel regions
(one per GEMM and attention call), each ending at a barrier. On an idle machine two threads
are faster (SmolLM2 bf16, one row: 8.8 ms against 12.5 on one thread). When other processes
share the cores (the gateway's event loop, a client on the same host), every barrier waits for
a thread the OS has given to someone else: with a process taking half a core the two-thread
step took 14.4 ms and the one-thread step 12.9 ms, and served beside its client one stream got
a token every 16-18 ms on two threads against 13 ms on one (docs/BENCHMARKS.md §10.5).

So `ThreadTuner` measures both: for steps of at most `max_rows` tokens it runs the faster
choice by the median of its recent forward times (kept per row count), and every
`explore_every` such steps runs `probe` steps with the other choice to keep both current. The
outputs do not depend on it: the kernels split work by output rows and sequences, never a
sum, so one and several threads give bit-identical logits (tests/test_threads.py).
"""

from __future__ import annotations

from collections import deque
from statistics import median


class ThreadTuner:
    def __init__(self, full: int, max_rows: int = 4, explore_every: int = 64, probe: int = 4, window: int = 16):
        self.full, self.max_rows = full, max_rows
        self.explore_every, self.probe, self.window = explore_every, probe, window
        self.samples: dict[tuple[int, int], deque] = {}
        self.small_steps = 0

    def _times(self, rows: int, threads: int) -> deque:
        return self.samples.setdefault((rows, threads), deque(maxlen=self.window))

    def choose(self, rows: int) -> int:
        """Threads for a forward over `rows` tokens."""
        if self.full <= 1 or rows > self.max_rows:
            return self.full
        self.small_steps += 1
        for threads in (self.full, 1):                           # until both have been measured
            if len(self._times(rows, threads)) < self.probe:
                return threads
        best = self.preferred(rows)
        other = 1 if best == self.full else self.full
        return other if self.small_steps % self.explore_every < self.probe else best

    def record(self, rows: int, threads: int, seconds: float) -> None:
        if self.full > 1 and rows <= self.max_rows:
            self._times(rows, threads).append(seconds)

    def preferred(self, rows: int) -> int | None:
        """The choice measured faster so far for `rows` tokens (None: not measured yet)."""
        a, b = self._times(rows, self.full), self._times(rows, 1)
        if not a or not b:
            return None
        return self.full if median(a) <= median(b) else 1
