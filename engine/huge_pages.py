"""Memory advised for transparent huge pages (2 MiB): the packed linear weights of a model side
by side in one region, in the order a step reads them (`Arena`, filled by
`packed_linear.arrange`), and the CPU KV pool (`region`, kv_cache.zeroed).

Why: a decode step of a few rows streams every weight once, so its time is the weights' bytes
over the memory's bandwidth plus what each call loses getting its stream going. Each packed
weight was its own allocation in 4 KiB pages: a SmolLM2 step walks 33,000 of them (int8) or
66,000 (bf16), a TLB miss and a page walk each, and the hardware prefetchers stop at every page
boundary. torch's CPU allocator gives large blocks huge pages only with THP_MEM_ALLOC_ENABLE set
before it first allocates, and only for blocks of 2 MiB or more (a layer's weights are 0.3-1.8
MB in int8). Here they are copied once, at load, into one private anonymous mapping that
madvise(MADV_HUGEPAGE) asks the kernel to back with huge pages (where transparent huge pages are
`madvise` or `always`; where they are `never`, or off Linux, the region is ordinary memory and
only the order remains). Each weight starts on a 4 KiB boundary.

SmolLM2's one-row decode step in process, the same engine with and without it (Zen 4 host,
2026-12-06, steps alternating in one process): int8 7.13 -> 6.87 ms, bf16 12.03 -> 11.58 ms,
bf16 at 8 rows 15.26 -> 14.39 ms; the same region in 4 KiB pages gained 1 % (int8 6.31 -> 6.24).

The KV pool's blocks are read at every step too, 6 KB a block and layer in bf16 for SmolLM2,
scattered over the pool. It was a shared mapping, which the host's shmem setting (`never` here)
keeps in 4 KiB pages; in a private one advised as above, one-row int8 steps took 7.02 -> 6.83
ms at 300 tokens of context and 8.63 -> 8.38 ms at 1,000 (8 bf16 rows level).
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 4096


def region(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of zeros, starting on a 2 MiB boundary, in a private anonymous mapping
    advised for huge pages where the OS has them: the OS hands its pages out zeroed when first
    touched, so what is never written is never resident. torch's memory where there is no
    anonymous mmap. The tensor keeps the map."""
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)   # before any page is touched: faults take whole huge pages
    except (AttributeError, OSError):         # not Linux, or a kernel without THP: ordinary pages
        pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


class Arena:
    """One region() holding tensors of the given byte sizes side by side, each starting on a
    4 KiB boundary; `copy(i, t)` puts the i-th in place."""

    def __init__(self, sizes: list[int]):
        self.starts, end = [], 0
        for size in sizes:
            self.starts.append(end)
            end += -(-size // ALIGN) * ALIGN
        self.whole = region(end)

    def copy(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` (its shape and dtype, contiguous) in the i-th place."""
        start = self.starts[i]
        placed = self.whole[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        with torch.no_grad():
            placed.copy_(t)
        return placed


def huge_bytes(t: torch.Tensor) -> int | None:
    """Bytes of the mapping holding `t` that the kernel backs with huge pages (its
    AnonHugePages in /proc/self/smaps), or None where that is not known (off Linux)."""
    addr = t.data_ptr()
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
