"""streamgate's in-process inference engine: paged KV cache, continuous batching,
chunked prefill. See DESIGN.md for the contract."""

from .config import EngineConfig, SamplingParams
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
