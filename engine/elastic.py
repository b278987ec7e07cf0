"""The elastic thread pool of the C++ kernels (csrc/parallel.h), for CPU steps beside other
work on the same cores (the event loop, a client on the same host).

OpenMP ends each parallel region at a barrier every thread of the team must reach, so a step's
~150 regions each wait for a worker the OS has given to someone else. Served beside GuideLLM on
2 cores, two OpenMP threads made what one thread makes in process (SmolLM2 bf16, Intel AMX host,
2026-12-05: 34.2 / 159.4 / 284.9 tok/s at 1 / 8 / 32 streams; 34.5 / 162.3 / 254.1 with
OMP_NUM_THREADS=1; in process 55.8 / 249 / 396 on two threads). On the elastic pool the
stepping thread claims chunks of each loop with helper threads and never waits for a helper
that has not started one; the step's torch operators run on one thread (torch's OpenMP team
is not used), so the kernels must run every step: the bf16 linears on the block kernel at every
size (no oneDNN copy; AMX tiles above 4 rows where the CPU has them), which is the
avx512_bf16 build's, in bf16 (int8 weights too: their prefill steps on AMX tiles, or dequantized
into the block kernel's layout without AMX, quantization.py). On a CPU without bf16 dot
products (packed_linear.bf16_widened) every bf16 step of the fused forward runs on the kernels
too; int8 weights' big steps there run MKL's GEMM on dequantized weights (`library_gemm`: on
torch's threads for its duration).

On by default when served (`EngineConfig.elastic_threads` None: AsyncEngine turns it on), off
in process. Served beside GuideLLM (bench.peers, 2026-12-05, `afe2f57`): 47.5 / 176.4 / 326.4
tok/s at 1 / 8 / 32 streams against 34.9 / 160.2 / 268.5 on OpenMP, TTFT p99 at 32 streams
2.39 against 2.21 s. In process (quiet) it measured level or ahead (58.3 / 274.4 / 436.7
against 57.6 / 262.2 / 423.9 tok/s), and is left opt-in there.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

log = logging.getLogger("streamgate.engine")

# A helper spins this long after its last chunk (yielding its core to any other thread after
# the first 20 us), then sleeps until the next loop wakes it. 200 us until 2026-12-07: on the
# Intel Ice Lake host (KVM) a one-row bf16 step on the pool took 18.2-19.9 ms at 200 us, 16.7
# at 500, 16.1 at 1,000, 15.8 at 2,000 (15.6 on OpenMP); served, one stream's ITL p50 23.3 ms
# at 200 us, 17.3 at 2,000 (30.3 on OpenMP). The C++ op's own default stays 200.
SPIN_US = int(os.environ.get("STREAMGATE_ELASTIC_SPIN_US", "1000"))


def pool_threads() -> int:
    """Threads that run the kernels' loops on the elastic pool (0: off, OpenMP runs them)."""
    from .kernels import load_kernels

    if not load_kernels():
        return 0
    import torch

    return int(torch.ops.streamgate.elastic_threads(-1))


def fits(dtype, fused: bool = True) -> str | None:
    """Why the elastic pool cannot run this engine's steps in `dtype` (None: it can; int8 weights
    too, whose steps all run on the kernels in the avx512_bf16 build: quantization.py). Without
    bf16 dot products only the fused forward's (`fused`: fused_llama.bf16_widened_here) run on
    the kernels; transformers' forward would run torch's emulated bf16 matmuls on one thread."""
    import torch

    from .kernels import load_kernels, loaded_variant

    if not load_kernels():
        return "the C++ kernels did not build"
    if dtype != torch.bfloat16:     # first: true in every build, so the reason does not depend on the host
        return f"{dtype}: the pool is measured in bf16 only (fp32's big steps ran on oneDNN or MKL until 2026-12-07)"
    from .packed_linear import bf16_widened     # every step on the shift+FMA kernel

    widened = bf16_widened()
    if loaded_variant() != "avx512_bf16" and not (widened and fused):
        return (f"the {loaded_variant()} kernels leave big steps to oneDNN (the avx512_bf16 build runs them all"
                + (", and without it only the fused forward's)" if widened else ")"))
    return None


_torch_threads = 1          # torch's thread count when the pool started: library_gemm's


@contextmanager
def library_gemm():
    """Around a library GEMM a step cannot leave (int8's dequantized big steps on a CPU without
    bf16 dot products): while the pool runs the kernels' loops, torch's operators get the
    threads torch had when it started (then one again), so a 300-token prefill's GEMMs are not
    left to one core; OpenMP's team then serves those GEMMs only."""
    import torch

    if pool_threads() <= 1 or _torch_threads <= 1:
        yield
        return
    torch.set_num_threads(_torch_threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def start(config, dtype, fused: bool = True) -> bool:
    """Start the pool with as many threads as torch has (the stepping thread and helpers) if
    this engine's steps run on the kernels; False (and why, logged) if not."""
    import torch

    threads = torch.get_num_threads()
    if threads <= 1:
        return False
    if (why := fits(dtype, fused)) is not None:
        log.warning("elastic threads off: %s", why)
        return False
    if pool_threads() != threads:
        torch.ops.streamgate.elastic_threads(threads, SPIN_US)
    global _torch_threads
    _torch_threads = threads
    log.info("elastic threads: the kernels' loops on %d threads, torch's operators on one", threads)
    return True


def one_torch_thread() -> None:
    """On the stepping thread, before each step: torch's operators on this thread alone (the
    OpenMP setting is the calling thread's own)."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
