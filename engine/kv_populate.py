"""The CPU KV pool's pages made resident from the start, in the background, in the order blocks
are handed out.

kv_cache.zeroed() maps the pool lazily, so a block's pages are faulted in by the first step that
writes its keys and values. On the Zen 4 KVM host (2026-12-06) that cost was large: a 2 MiB huge
page's first write took ~1.6 ms (0.32 s for 256 MiB, five times a 4 KiB page's), so `write_kv`
for a 512-token chunk took 0.73 ms a layer against 0.02 once the pages were there, 22 ms of a
352 ms prefill step; every fresh server paid it until its traffic had touched the whole pool
(1 GiB by default: ~46,000 tokens of SmolLM2), and a benchmark's run never got that far.

So a daemon thread asks the kernel to fault the pool in, without writing it (madvise
MADV_POPULATE_WRITE, Linux 5.14+: "as if manually writing to each page", no data changed): a
piece (every layer's K and V slab over the same ~2 MiB of tokens a slab) at a time, in ascending
token order, which is the order block_pool hands out never-used blocks. It runs under SCHED_IDLE,
so it takes only CPU time nothing else wants: a server's start-up and the gaps between its steps.
It holds the pool by weak reference between pieces, and dropping the pool ends it. A step that
writes pages the thread has not reached faults them as before, and a write racing the thread is
safe, as the advice never changes a byte. It stops where the next piece would leave less than
RESERVE of the host's available memory (or its cgroup's: under cgroup v1 its usage counts page
cache too, so there it stops early rather than late), so a pool sized past what the host can
hold stays lazy beyond that point instead of calling the OOM killer. Where the advice is missing
(other OSes, older kernels), the pool stays lazy; `kv_cache_populate=False` keeps it lazy
(resident only as used). Following the allocator instead (a piece or two ahead of the highest
block a step writes), tried: under steady load SCHED_IDLE left it no time, and the steps' writes
faulted as before (`write_kv` 0.46-0.48 ms a 512-token layer against 0.73 lazy, 0.02 populated).

Measured on that host (SmolLM2-135M bf16, 1 GiB pool): populating takes 1.8-4.1 s of otherwise
idle CPU after the engine is built (logged when done). An in-process closed loop of 32 streams
(96 requests, 286-token prompts, 64 out) spent 1.63-1.94 s of system time lazy against
0.04-0.11 s populated, in 27-29 s.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import threading
import time
import weakref

import torch

log = logging.getLogger("streamgate.engine")

MADV_POPULATE_WRITE = 23          # linux/mman.h
PIECE_BYTES = 2 << 20             # per slab and piece: one huge page's worth of tokens
PAGE = mmap.PAGESIZE
RESERVE = 1 << 30                 # memory the thread leaves free for everything else


def available_bytes() -> int | None:
    """Memory the OS can still hand out: MemAvailable, less where a cgroup's limit (v2, else
    v1) is nearer; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         (v1 + "limit_in_bytes", v1 + "usage_in_bytes")):
        try:
            with open(limit) as f, open(usage) as g:
                cap = f.read().strip()
                if cap != "max" and int(cap) < 1 << 60:
                    found.append(int(cap) - int(g.read()))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)       # CDLL calls release the GIL
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def slabs(pool: torch.Tensor) -> tuple[int, int, int, int]:
    """A contiguous pool [L, S, ...] as plain integers: (address, slab bytes, bytes a token, L)."""
    slab = pool[0].numel() * pool.element_size()
    return pool.data_ptr(), slab, slab // pool.shape[1], pool.shape[0]


def advise(geometry: tuple[int, int, int, int], t0: int, t1: int) -> bool:
    """populate() over slabs()' integers. No torch call: the thread runs only this and ctypes
    (see Populator)."""
    fn = _madvise()
    if fn is None:
        return False
    base, slab, per_token, layers = geometry
    for layer in range(layers):
        start = base + layer * slab + t0 * per_token
        end = base + layer * slab + t1 * per_token
        start -= start % PAGE
        end += -end % PAGE
        if fn(start, end - start, MADV_POPULATE_WRITE) != 0:
            log.debug("KV pool stays lazy: madvise(MADV_POPULATE_WRITE) failed, errno %d", ctypes.get_errno())
            return False
    return True


def populate(pool: torch.Tensor, t0: int, t1: int) -> bool:
    """Fault in tokens [t0, t1) of every slab of `pool` ([L, S, ...], contiguous) writable,
    without writing them. False where the OS refuses the advice."""
    return advise(slabs(pool), t0, t1)


class Populator:
    """The background thread over CPU pools of one shape [L, S, ...] (a pool's K and V).

    The thread calls no torch function: their bindings release the GIL, and a daemon thread
    that takes it back while the interpreter finalizes is ended by pthread_exit, whose unwinding
    through the binding's noexcept GIL guard calls std::terminate. A server stopped while the
    pool was still being populated then died of SIGABRT after its clean shutdown (seen in CI,
    2026-12-07). So the pools' addresses are read here, as integers, and the thread holds the
    tensors (by weak reference, made strong for a piece) only to know their memory is still
    mapped."""

    def __init__(self, pools: list[torch.Tensor], block_size: int):
        self._geometry = [slabs(p) for p in pools]
        _, _, per_token, layers = self._geometry[0]
        self.tokens = pools[0].shape[1]
        self.piece = max(block_size, PIECE_BYTES // per_token // block_size * block_size)   # tokens
        self.populated = 0               # tokens [0, populated) done
        self.piece_bytes = self.piece * per_token * layers * len(pools)     # every slab of every pool
        self.failed = False
        self.short_of_memory = False     # stopped to leave RESERVE free: the rest stays lazy
        self.stopped = False             # the thread has ended (done, failed or the pool dropped)
        self._cv = threading.Condition()
        self._refs = [weakref.ref(p) for p in pools]
        threading.Thread(target=self._run, name="sg-kv-populate", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the thread has ended or `timeout` passed; True if it populated the whole
        pool."""
        with self._cv:
            self._cv.wait_for(lambda: self.stopped, timeout)
            return self.populated == self.tokens

    def _run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # this thread only
        except (AttributeError, OSError):
            pass
        start = time.perf_counter()
        try:
            while self.populated < self.tokens and not self.failed:
                pools = [r() for r in self._refs]
                if any(p is None for p in pools):
                    return                                     # the pool was dropped
                end = min(self.tokens, self.populated + self.piece)
                if (free := available_bytes()) is not None and free - self.piece_bytes < RESERVE:
                    self.short_of_memory = True
                    log.info("KV pool populated up to token %d of %d: %d MiB left free", self.populated,
                             self.tokens, free >> 20)
                    return
                if all(advise(g, self.populated, end) for g in self._geometry):
                    self.populated = end
                else:
                    self.failed = True
                del pools
            if self.populated == self.tokens:
                log.info("KV pool resident: %d MiB faulted in over %.1f s",
                         self.tokens * self.piece_bytes // self.piece >> 20, time.perf_counter() - start)
        finally:
            with self._cv:
                self.stopped = True
                self._cv.notify_all()


def populator(pools: list[torch.Tensor], block_size: int) -> Populator | None:
    """A Populator over the CPU pools, or None where there is nothing to do or no way to."""
    pools = [p for p in pools if p.device.type == "cpu" and p.numel() and p.is_contiguous()]
    if not pools or not hasattr(os, "SCHED_IDLE") or _madvise() is None:
        return None
    return Populator(pools, block_size)
