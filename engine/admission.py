"""Admission strategies: how a step takes in prompts. The default is the scheduler's own
rule (decode first, then chunks of prompts); the other two exist only so benchmarks can
compare against them, and live here so `Scheduler.schedule()` has one path.

- Continuous     decode first; ongoing prefills and new requests fill the rest, in chunks.
- PrefillFirst   vLLM v0 style, unchunked: a step that can admit new prompts runs only
                 those, whole, and the decodes wait (`chunked_prefill=False`).
- StaticBatching request-level batches: admit only until the batch's first token, then run
                 the batch to completion before the next one starts (`batching="static"`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import EngineConfig
from .sequence import Sequence

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .scheduler_output import SchedulerOutput


class Continuous:
    def is_open(self, running: list[Sequence]) -> bool:
        """Whether new requests may join the batch this step."""
        return True

    def chunk(self, left: int, budget: int) -> int:
        """Tokens of a prompt to compute this step: all that is left, or what the budget allows."""
        return min(left, budget)

    def prompts_alone(self, sched: Scheduler, out: SchedulerOutput, now: float) -> bool:
        """Whether this step was filled with new prompts only (the decodes then wait)."""
        return False


class PrefillFirst(Continuous):
    def chunk(self, left: int, budget: int) -> int:
        return left if left <= budget else 0

    def prompts_alone(self, sched: Scheduler, out: SchedulerOutput, now: float) -> bool:
        sched.admit(out, now)
        return not out.is_empty


class StaticBatching(Continuous):
    def is_open(self, running: list[Sequence]) -> bool:
        return not any(s.num_output_tokens > 0 for s in running)


def make_admission(config: EngineConfig) -> Continuous:
    if config.batching == "static":
        return StaticBatching()
    return Continuous() if config.chunked_prefill else PrefillFirst()
