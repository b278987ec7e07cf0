"""Iteration-level scheduler: each step re-forms the batch.

One rule: each step, a sequence's computed tokens catch up with its tokens, under a token
budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Running sequences
that are decoding get their one token first, so streams never stall behind a long prompt;
prefills (ongoing, then newly admitted) fill what budget is left, in chunks.

When a decoding sequence cannot get a KV block, the least urgent running sequence is
preempted by recompute: its blocks are freed and it goes back to the waiting queue with its
generated tokens kept, to be recomputed like a prompt (prefix caching often makes that
cheap). A waiting request is admitted only if all its tokens fit with a watermark of free
blocks left over, so admission never causes thrashing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .policy import Policy, make_policy
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's batch: decode entries first, then prefill chunks."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_decode_tokens: int = 0

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        if seq.num_uncomputed_tokens == 1:
            self.num_decode_tokens += 1

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.policy: Policy = make_policy(config)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.watermark_blocks = int(config.watermark * block_manager.num_blocks)
        self.num_preemptions = 0
        self.last_output = SchedulerOutput()

    # -- queues ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` for `reason`, wherever it is, and free its blocks now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: self.policy.key(s, now))

        # 1. Decode: every running sequence with one token to compute, most urgent first.
        for seq in [s for s in self.running if not s.is_prefill]:
            if seq.status is not SequenceStatus.RUNNING:
                continue                                   # preempted earlier in this loop
            if not self._reserve_decode_slot(seq, out, now):
                continue
            out.add(seq, 1)
            budget -= 1

        # 2. Ongoing prefills (chunked), in urgency order.
        for seq in [s for s in self.running if s.is_prefill and s not in out.seqs]:
            n = self._chunk(seq, budget)
            if n == 0:
                break
            out.add(seq, n)
            budget -= n

        # 3. Admit waiting requests while budget, sequence slots and KV blocks allow.
        self.waiting.sort(key=lambda s: self.policy.key(s, now))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.can_allocate(seq, reserve=self.watermark_blocks):
                break                                       # defer: admission must not thrash
            n = self._chunk(seq, budget, fresh=True)
            if n == 0:
                break
            self.waiting.pop(0)
            self.bm.allocate(seq)
            n = self._chunk(seq, budget)                   # prefix hits shrink the work
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            out.add(seq, n)
            budget -= n

        self.last_output = out
        return out

    def _chunk(self, seq: Sequence, budget: int, fresh: bool = False) -> int:
        """Tokens of `seq` to compute this step: all that is left, or a chunk of the budget."""
        left = seq.num_tokens if fresh else seq.num_uncomputed_tokens
        if not self.config.chunked_prefill:
            return left if left <= budget else 0
        return min(left, budget)

    def _reserve_decode_slot(self, seq: Sequence, out: SchedulerOutput, now: float) -> bool:
        """Find a KV slot for `seq`'s next token, preempting less urgent sequences if needed.
        Returns False if `seq` itself had to be preempted."""
        while not self.bm.can_append(seq, 1):
            candidates = [s for s in self.running if s not in out.seqs]
            victim = max(candidates, key=lambda s: self.policy.victim_key(s, now))
            if self.policy.key(victim, now) < self.policy.key(seq, now):
                victim = seq                               # never preempt a more urgent one
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.bm.append_slots(seq, 1)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: free the blocks, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)
        out.preempted.append(seq)
