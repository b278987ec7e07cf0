"""How many threads a step runs on, chosen by measuring it (CPU only).

A decode step of a few rows is bound by reading the weights and by ~150 parallel regions
(one per GEMM and attention call), each ending at a barrier. On an idle machine two threads
are faster (SmolLM2 bf16, one row: 8.8 ms against 12.5 on one thread). When other processes
share the cores (the gateway's event loop, a client on the same host), every barrier waits for
a thread the OS has given to someone else: with a process taking half a core the two-thread
step took 14.4 ms and the one-thread step 12.9 ms, and served beside its client one stream got
a token every 16-18 ms on two threads against 13 ms on one (docs/BENCHMARKS.md §10.5).

So `ThreadTuner` measures both: for steps of at most `max_rows` tokens it runs the faster
choice by the median of its recent forward times (kept per row count), and every
`explore_every` such steps runs `probe` steps with the other choice to keep both current.
With `large` it does the same for every larger step, by power-of-two buckets of rows and
time per row, exploring every `large_every` steps of a bucket (a one-thread probe of a
prefill chunk costs up to twice its step on an idle host: 4 in 256 steps, ~1.5 %). Beside a
process that takes a core (a load client on the same host), two threads' prefill and batched
steps stalled at every barrier: SmolLM2 bf16, 32 streams in process beside one spinning
process, 58 tok/s on two threads against 110 on one (Zen 4, 2026-12-04). The outputs do not
depend on it: the kernels split work by output rows and sequences, never a sum, so one and
several threads give bit-identical logits (tests/test_threads.py); `large` is only for
forwards on those kernels at every size (model_runner.py), not where oneDNN or MKL run big
steps. It is opt-in (`EngineConfig.adaptive_threads_all_steps`): served under GuideLLM, whose
load comes in bursts, one run at 32 streams made 152.8 tok/s with it against 178.7 without
(docs/BENCHMARKS.md §6): a choice probed 4 steps in 256 lags the client's phases.
"""

from __future__ import annotations

from collections import deque
from statistics import median


class ThreadTuner:
    def __init__(self, full: int, max_rows: int = 4, explore_every: int = 64, probe: int = 4, window: int = 16,
                 large: bool = False, large_every: int = 256):
        self.full, self.max_rows, self.large = full, max_rows, large
        self.explore_every, self.probe, self.window, self.large_every = explore_every, probe, window, large_every
        self.samples: dict[tuple[int, int], deque] = {}
        self.steps: dict[int, int] = {}                          # measured steps per key

    def key(self, rows: int) -> int | None:
        """Row count up to max_rows; above it the power-of-two bucket (with `large`), else None."""
        if rows <= self.max_rows:
            return rows
        return 1 << (rows - 1).bit_length() if self.large else None

    def _times(self, key: int, threads: int) -> deque:
        return self.samples.setdefault((key, threads), deque(maxlen=self.window))

    def choose(self, rows: int) -> int:
        """Threads for a forward over `rows` tokens."""
        key = self.key(rows)
        if self.full <= 1 or key is None:
            return self.full
        n = self.steps[key] = self.steps.get(key, 0) + 1
        for threads in (self.full, 1):                           # until both have been measured
            if len(self._times(key, threads)) < self.probe:
                return threads
        best = self.preferred(rows)
        other = 1 if best == self.full else self.full
        every = self.explore_every if rows <= self.max_rows else self.large_every
        return other if n % every < self.probe else best

    def record(self, rows: int, threads: int, seconds: float) -> None:
        key = self.key(rows)
        if self.full > 1 and key is not None:
            self._times(key, threads).append(seconds / rows)

    def preferred(self, rows: int) -> int | None:
        """The choice measured faster so far for `rows` tokens (None: not measured yet)."""
        key = self.key(rows)
        if key is None:
            return None
        a, b = self._times(key, self.full), self._times(key, 1)
        if not a or not b:
            return None
        return self.full if median(a) <= median(b) else 1


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (`omp_pause_resource_all(omp_pause_hard)`
    of the OpenMP runtime torch loaded); True if the runtime had it.

    For the thread that loaded the model, once it is done: libgomp keeps one pool of workers per
    thread that ever ran a parallel region, and once it manages more threads than there are
    CPUs it stops spinning between regions (a 100-spin "throttled" wait, then sleep), so every
    parallel region of the engine thread then waits for its worker to be woken. SmolLM2 bf16
    on the 2-core Intel AMX host (2026-12-05): a one-row step took 25.7 ms on a thread started
    after another thread's pool existed, 16.1 ms without; one linear 99 against 19 us. The
    loader's pool so freed, the engine thread's team is the only one. A later parallel region
    on the calling thread makes a new pool, so this is safe to call anywhere outside one.

    Opt-in (`EngineConfig.openmp_one_team`): served beside GuideLLM on the same 2 cores, one
    stream gained (ITL p50 27 -> 17-18 ms, 34.9 -> 38.1-41.6 tok/s) but 8 streams lost (157.8
    -> 124.8-134.3 tok/s, TTFT p50 0.19 -> 0.38-0.70 s) and TTFT p99 at 32 rose (2.4 -> 3.5-5.7
    s): the spinning team then takes the cycles the event loop and the client need. With
    GOMP_SPINCOUNT=20000 in the environment (spin ~0.2 ms, not libgomp's ~300k) it did
    better than with the default (docs/BENCHMARKS.md §6)."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps
                     if any(name in line for name in ("libgomp", "libiomp", "libomp")) and "/" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause(2) == 0                       # omp_pause_hard
    return False
