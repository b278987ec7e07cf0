"""streamgate's in-process inference engine: paged KV cache, continuous batching,
chunked prefill. See DESIGN.md for the contract."""

import os

# Before torch loads libgomp: with one OpenMP team (threads.release_openmp_pool) the engine's
# workers spin for the next parallel region; libgomp's default, ~300k spins after each region,
# kept a worker spinning between steps too, taking the core the event loop and a client on the
# same host need (served, 2 cores, Intel AMX host, 2026-12-05: TTFT p99 at 8 streams 3.27 s
# against 0.69 s with 20k spins, ~0.2 ms; in-step gaps between regions are microseconds). An
# explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from .config import EngineConfig, SamplingParams  # noqa: E402
from .errors import EngineOverloaded
from .grammar import Grammar
from .port import EngineClient, EngineLimits
from .sequence import RequestOutput, Sequence, SequenceStatus, TokenLogprob
from .stats import EngineStats


def __getattr__(name: str):
    # The engines pull in torch and transformers; import them on first use so that the
    # scheduler, block manager and config stay importable (and testable) without torch.
    if name == "LLMEngine":
        from .llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncEngine":
        from .async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["EngineConfig", "SamplingParams", "Grammar", "RequestOutput", "TokenLogprob", "Sequence", "SequenceStatus",
           "LLMEngine", "AsyncEngine", "EngineOverloaded", "EngineClient", "EngineLimits", "EngineStats"]
