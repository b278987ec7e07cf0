"""The engine's port: what a server holds when it holds an engine.

`EngineClient` is the surface the gateway is typed against (as vLLM's
`vllm/engine/protocol.py`); `AsyncEngine` implements it and so do the tests' fakes
(tests/fake_engine.py). `EngineLimits` is published once, when the engine has started:
everything a caller may check a request against without asking the engine thread.
`EngineStats` (engine/stats.py) is the snapshot the engine thread builds when asked.

Checks a request gets on the caller's side (`check_request`, `check_capacity`) are pure
functions of the request, the limits and the queue numbers given; the engine thread's
`LLMEngine.add_request` repeats the ones that depend on its state and is the one that
decides.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .config import EngineConfig, SamplingParams
from .errors import EngineOverloaded
from .sequence import RequestOutput
from .stats import EngineStats


@dataclass(frozen=True)
class EngineLimits:
    """What the engine can take, fixed once the model is loaded."""

    max_model_len: int          # prompt + output tokens of one request
    vocab_size: int             # token ids are in [0, vocab_size)
    block_size: int             # tokens per KV block
    num_kv_blocks: int          # KV blocks in the device pool
    usable_kv_blocks: int       # the most one request can ever hold (the pool less the watermark)
    max_num_seqs: int           # sequences in one step's batch
    max_num_batched_tokens: int  # tokens in one step (the token budget's ceiling)
    max_queued_requests: int    # waiting requests before EngineOverloaded
    max_queued_tokens: int      # waiting tokens before EngineOverloaded
    kv_groups: int = 1          # block tables per sequence (kv_groups.py: a hybrid sliding model's)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks a sequence of `num_tokens` holds at allocation, every group's table."""
        return self.kv_groups * -(-num_tokens // self.block_size)


def check_request(limits: EngineLimits, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  priority: int = 0, deadline: float | None = None, weight: float = 1.0) -> None:
    """Raise ValueError naming the bad field of a request the engine could never serve."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string (got {request_id!r})")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams (got {type(params).__name__})")
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise ValueError("prompt_token_ids must be a non-empty list of token ids")
    if not all(isinstance(t, int) and 0 <= t < limits.vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt_token_ids must hold token ids in [0, {limits.vocab_size})")
    if len(prompt_token_ids) >= limits.max_model_len:
        raise ValueError(f"prompt_token_ids: the prompt has {len(prompt_token_ids)} tokens but the "
                         f"context is {limits.max_model_len} (max_model_len), including at least one output token")
    params.validate(limits.vocab_size)
    if not isinstance(priority, int) or isinstance(priority, bool) or not -2**31 <= priority < 2**31:
        raise ValueError(f"priority must be a 32-bit integer (got {priority!r})")
    if deadline is not None and (not isinstance(deadline, (int, float)) or not math.isfinite(deadline)):
        raise ValueError(f"deadline must be a finite time.monotonic() value or None (got {deadline!r})")
    if not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
        raise ValueError(f"weight must be a finite number > 0 (got {weight!r})")
    blocks = limits.blocks_for(len(prompt_token_ids) + 1)
    if blocks > limits.usable_kv_blocks:
        raise ValueError(f"prompt_token_ids: the prompt needs {blocks} KV blocks but only {limits.usable_kv_blocks} "
                         f"can ever be free (num_kv_blocks={limits.num_kv_blocks})")


def check_capacity(limits: EngineLimits | EngineConfig, waiting: int, queued_tokens: int, num_tokens: int) -> None:
    """Raise EngineOverloaded if one more request of `num_tokens` would pass a queue limit,
    with `waiting` requests of `queued_tokens` tokens already queued."""
    if waiting >= limits.max_queued_requests:
        raise EngineOverloaded(f"engine overloaded: {waiting} requests already queued "
                               f"(max_queued_requests={limits.max_queued_requests})", limit="max_queued_requests")
    if queued_tokens + num_tokens > limits.max_queued_tokens:
        raise EngineOverloaded(f"engine overloaded: {queued_tokens} tokens already queued "
                               f"(max_queued_tokens={limits.max_queued_tokens})", limit="max_queued_tokens")


@runtime_checkable
class EngineClient(Protocol):
    """An engine as a server uses it, on the event loop. Implementations subclass it to
    declare so; tests/test_engine_port.py checks that each defines every member with the
    same signature. Bad input raises ValueError naming the field; a full queue raises
    EngineOverloaded; both before anything is queued.

    - `start()` loads and starts stepping; `stop()` aborts what runs (each stream then ends
      with `finish_reason` 'abort') and stops. `ready`: started and not failed; `error`:
      what ended the engine, or None.
    - `limits` and `tokenizer` are valid once `start()` has returned.
    - `validate(...)`: raise what `generate` would for this request; changes nothing.
    - `generate(...)`: the request's outputs, ending with exactly one `finished` output.
      Leaving the iterator early aborts the request. `on_final(output)` is called once, on
      the event loop, with the final output of a request that was queued (even after the
      consumer left): it carries the token counts billing needs.
    - `abort(id)`: end a request; unknown ids are ignored.
    - `stats()`: a snapshot built on the engine's side for this call (and shared with the
      calls waiting at the same time); `metrics_registry`: its Prometheus collectors.
    """

    ready: bool
    error: BaseException | None
    limits: EngineLimits
    tokenizer: Any                  # the HF tokenizer (its chat template)
    metrics_registry: Any           # a prometheus_client CollectorRegistry

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 priority: int = 0, deadline: float | None = None, weight: float = 1.0) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 priority: int = 0, tenant: str | None = None, deadline: float | None = None,
                 weight: float = 1.0, validated: bool = False,
                 on_final: Callable[[RequestOutput], None] | None = None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> EngineStats: ...
