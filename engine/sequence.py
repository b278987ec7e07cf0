"""Per-request state. Everything the scheduler and block manager know about a request
lives on its `Sequence`; derived values are properties."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from .config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued; holds no KV blocks
    RUNNING = "running"      # in the batch; holds KV blocks
    SWAPPED = "swapped"      # KV copied to the host pool; holds host blocks
    FINISHED = "finished"    # done for any reason; holds nothing

    @property
    def finished(self) -> bool:
        return self is SequenceStatus.FINISHED


class Sequence:
    """One request: its tokens, its KV blocks and how far the model has computed it.

    The scheduler's single rule (vLLM's): each step, a sequence's computed tokens catch up
    with its tokens. A fresh prompt has `num_computed_tokens == 0`; decode has exactly one
    token to compute. A sequence preempted by recompute drops back to zero computed
    tokens and keeps its generated tokens, which are simply recomputed like a prompt.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 priority: int = 0, tenant: str | None = None, deadline: float | None = None,
                 arrival_time: float | None = None, eos_token_ids: frozenset[int] = frozenset(),
                 weight: float = 1.0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.tenant = tenant
        self.weight = weight                  # the tenant's share under the fair policy
        self.deadline = deadline
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.eos_token_ids = eos_token_ids
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_tables: list[list[int]] = []   # one per KV-cache group (block_manager.py)
        self.host_tables: list[list[int]] = []    # host-pool blocks per group while SWAPPED
        self.block_hashes: list[bytes] = []   # hashes of this sequence's full, computed blocks
        self._num_computed_tokens = 0
        # The most prompt tokens ever held computed (prefix-cache hits included): freeing
        # the blocks (abort, deadline, preemption) zeroes the count above, and billing
        # needs the work that was done.
        self.num_computed_prompt_tokens = 0
        self.num_cached_tokens = 0            # prefix-cache hits at the last allocation
        self.num_preemptions = 0
        self.num_seat_preemptions = 0         # preemptions to give an arrival its seat (bounded)
        self.admitted_step: int | None = None  # scheduler step of the last (re)admission
        # Positions [0, num_billed_tokens) have been charged to the tenant (input at
        # scheduling, output at sampling); recomputing them after a preemption is free.
        self.num_billed_tokens = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.generator = None                 # sampler's per-request RNG (set by the sampler)
        # Constrained decoding: the llguidance matcher and its compile (grammar_runtime.py).
        # It lives here, not in the KV cache, so preemption (recompute or swap) keeps it.
        self.grammar_state = None
        # Prompt logprobs (prompt_logprobs.py): [None] then one per prompt token as its
        # prefill computes them; handed out once, with the first output (`_sent`).
        self.prompt_logprobs: list[TokenLogprob | None] | None = None if params.prompt_logprobs is None else [None]
        self.prompt_logprobs_sent = False
        self.spec_state = None                # speculative.py's n-gram index and acceptance
        # Text and stop strings (an engine.detokenizer.IncrementalDetokenizer, or None: no
        # text): fed by Scheduler.append_token, which finishes the sequence on a stop string.
        self.detokenizer = None
        self.new_text = ""                    # the text of the token sampled last ("" if none)

    @property
    def num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        self._num_computed_tokens = n
        if n > self.num_computed_prompt_tokens:
            self.num_computed_prompt_tokens = min(n, len(self.prompt_token_ids))

    # -- derived values ---------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def block_table(self) -> list[int]:
        """The first KV-cache group's table (the only one unless the model is hybrid)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def host_table(self) -> list[int]:
        return [h for host in self.host_tables for h in host]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def computes_prompt(self) -> bool:
        """The tokens left to compute are prompt work (fresh or recomputed), not a decode.
        Unlike `is_prefill`, true for a prompt's final 1-token chunk too."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_prefill(self) -> bool:
        """More than one token to compute: a prompt (or a recomputed sequence) catching up."""
        return self.num_uncomputed_tokens > 1

    @property
    def can_sample(self) -> bool:
        """False while the request's grammar is still compiling: its last token waits."""
        return self.grammar_state is None or self.grammar_state.ready

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        end = self.num_tokens if end is None else end
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and the `top` most likely (token id, logprob)
    pairs, most likely first (empty unless SamplingParams.logprobs > 0). Log-probabilities
    are from the distribution the token was drawn from (sampler.py says which)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one step produced for one request. `new_text` is safe to show (no partial
    UTF-8 characters, no partial stop strings); `finish_reason` is set on the last one."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    queue_time_s: float | None = None   # arrival to first scheduled; set once it is known
    num_computed_prompt_tokens: int = 0   # prompt tokens whose KV the engine holds (billing)
    logprobs: list[TokenLogprob] | None = None   # aligned with new_token_ids when params.logprobs is set
    # SamplingParams.prompt_logprobs: one per prompt token (None for the first), on the
    # request's first output (with its first token, or its only one when max_tokens is 0)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """Fold a later output into this one (for consumers that fall behind)."""
        return RequestOutput(self.request_id, self.new_token_ids + later.new_token_ids,
                             self.new_text + later.new_text, later.finished, later.finish_reason,
                             later.num_prompt_tokens, later.num_output_tokens, later.error or self.error,
                             later.queue_time_s if later.queue_time_s is not None else self.queue_time_s,
                             later.num_computed_prompt_tokens,
                             _concat(self.logprobs, later.logprobs),
                             self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs)


def _concat(a: list | None, b: list | None) -> list | None:
    return b if a is None else a if b is None else a + b
