"""engine/kv_populate.py: the CPU KV pool faulted in by a background thread, without a byte of it
changed, in the order blocks are handed out; an engine whose pool is populated decodes as HF
does. Residency is read with mincore(2), the kernel's own record of which pages are present."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import weakref

import pytest
import torch

from engine.huge_pages import region
from engine.kv_cache import PagedKVCache
from engine.kv_populate import Populator, populate, populator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident(t: torch.Tensor) -> list[bool]:
    """Per page of `t`'s bytes (t starts on a page boundary): is it in memory?"""
    libc = ctypes.CDLL(None, use_errno=True)
    n = t.numel() * t.element_size()
    vec = (ctypes.c_ubyte * (-(-n // PAGE)))()
    assert t.data_ptr() % PAGE == 0
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(n), vec) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in vec]


def madvise_works() -> bool:
    probe = region(1 << 20)
    return populate(probe.view(1, -1), 0, probe.numel())


needs_populate = pytest.mark.skipif(not madvise_works(), reason="this kernel has no MADV_POPULATE_WRITE")


@needs_populate
def test_populate_faults_pages_in_without_changing_a_byte():
    """Tokens [t0, t1) of every layer's slab become resident; what was written stays, the rest
    stays zero, and (in 4 KiB pages: a mapping not advised for huge pages) pages outside the
    range stay out."""
    mapping = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    pool = torch.frombuffer(mapping, dtype=torch.bfloat16).view(4, 256, 8, 64 * 4)   # 1 MiB slabs, 4 KiB a token
    assert not any(resident(pool))
    pool[2, 10, 3, 5] = 7.0                                                   # token 10 of slab 2 written
    assert populate(pool, 64, 128)
    pages = resident(pool)                                                    # a page a token
    for layer in range(4):
        slab = pages[layer * 256:(layer + 1) * 256]
        assert all(slab[64:128]) and not any(slab[128:]), layer
        assert [i for i in range(64) if slab[i]] == ([10] if layer == 2 else [])
    assert float(pool[2, 10, 3, 5]) == 7.0
    assert int(torch.count_nonzero(pool)) == 1


@needs_populate
def test_the_thread_populates_the_whole_pool_and_lets_it_go():
    """Every page of K and V ends resident, zero; the thread holds no reference once it ends, so
    dropping the pool frees it."""
    k, v = (region(6 << 20).view(torch.float32).view(3, 512, 2, 512) for _ in range(2))
    k[1, 7, 1, 9] = 3.0
    pop = Populator([k, v], block_size=16)
    assert pop.wait(timeout=120)
    assert pop.populated == pop.tokens == 512 and pop.piece % 16 == 0 and not pop.failed
    assert pop.piece_bytes == (k.numel() + v.numel()) * 4                     # one piece: all of both
    assert all(resident(k)) and all(resident(v))
    assert float(k.sum()) == 3.0 and float(v.abs().sum()) == 0.0
    refs = [weakref.ref(k), weakref.ref(v)]
    del k, v
    assert all(r() is None for r in refs)


@needs_populate
def test_dropping_the_pool_ends_the_thread():
    """A pool dropped while the thread works: the thread ends at its next piece, never touching
    freed memory (it holds the pool only for a piece)."""
    pools = [region(64 << 20).view(64, 1 << 20) for _ in range(2)]   # 64 pieces of one token
    pop = Populator(pools, block_size=1)
    refs = [weakref.ref(p) for p in pools]
    del pools
    assert pop.wait(timeout=120) in (True, False)
    assert pop.stopped and all(r() is None for r in refs)


class Watched(torch.Tensor):
    """A tensor that records which thread calls each torch function on it."""
    threads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.threads.append(threading.current_thread().name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_thread_calls_no_torch_function():
    """Torch's bindings release the GIL; a daemon thread retaking it while the interpreter
    finalizes is ended by pthread_exit through a noexcept guard: SIGABRT after a clean shutdown.
    So the populating thread reads only integers taken on the caller's thread (madvise or not:
    where it is refused, the thread still makes its one try)."""
    pools = [region(4 << 20).view(torch.float32).view(4, 256, 1024).as_subclass(Watched) for _ in range(2)]
    Watched.threads.clear()
    pop = Populator(pools, block_size=16)
    pop.wait(timeout=120)
    assert pop.stopped
    assert Watched.threads and set(Watched.threads) == {threading.current_thread().name}


@needs_populate
def test_the_thread_stops_while_a_reserve_of_memory_is_left(monkeypatch):
    """Populating never takes the host's (or the cgroup's) last RESERVE bytes: where the next
    piece would, the thread stops there and the rest of the pool stays lazy."""
    import engine.kv_populate as kv_populate

    pools = [region(32 << 20).view(4, 16384, 512) for _ in range(2)]  # 4 slabs of 8 MiB: 4 pieces of 2 MiB each
    answers = iter([1 << 40, 1 << 40, kv_populate.RESERVE])           # plenty, plenty, then only the reserve
    monkeypatch.setattr(kv_populate, "available_bytes", lambda: next(answers))
    pop = Populator(pools, block_size=16)
    assert not pop.wait(timeout=120)
    assert pop.short_of_memory and pop.stopped and not pop.failed
    assert pop.populated == 2 * pop.piece < pop.tokens
    pages, done = resident(pools[0]), pop.populated * 512 // PAGE
    assert all(pages[:done]) and not any(pages[done:len(pages) // 4])     # slab 0: half of it


def test_available_bytes_reads_this_host():
    """MemAvailable (and a cgroup's limit where one is set): positive, below MemTotal."""
    from engine.kv_populate import available_bytes

    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemTotal:"))
    assert 0 < available_bytes() <= total


def test_an_engine_populates_its_pool_unless_told_not_to(tiny_model):
    """kv_cache_populate (default on) puts a populator on a CPU pool; off, none; and a pool
    populated in full decodes exactly as the lazy one and HF greedy."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.models import hf_greedy, load_reference, run_to_completion

    model = tiny_model("llama")
    prompts = [[5, 9, 13, 2, 7, 11, 3], [8, 1, 4, 4, 20, 17, 6, 12, 9, 30, 2]]
    out = {}
    for populate_on in (True, False):
        eng = LLMEngine(EngineConfig(model=model, num_kv_blocks=256, max_num_batched_tokens=16, max_num_seqs=4,
                                     kv_cache_populate=populate_on))
        pop = eng.runner.kv_cache.populator
        if not populate_on:
            assert pop is None
        elif madvise_works():
            assert pop.wait(timeout=120) and all(resident(eng.runner.kv_cache.k))
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out[populate_on] = run_to_completion(eng, {0: [("0", prompts[0], params)], 2: [("1", prompts[1], params)]})
    reference = load_reference(model)
    assert out[True] == out[False] == {str(i): hf_greedy(reference, p, 8) for i, p in enumerate(prompts)}


def test_no_populator_for_pools_it_cannot_serve():
    assert populator([torch.empty(0)], 16) is None
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=1, head_dim=8,
                         dtype=torch.float32, device=torch.device("cpu"))
    assert cache.populator is None                         # PagedKVCache populates only when asked
    assert mmap.PAGESIZE == PAGE
