"""Iteration-level scheduler: each step re-forms the batch.

One rule: each step, a sequence's computed tokens catch up with its tokens, under a token
budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Running sequences
that are decoding get their one token first, so streams never stall behind a long prompt;
ongoing prefills, swapped-out sequences coming back, and newly admitted requests fill what
budget is left, in chunks. The policy (policy.py) only orders; this module decides.

When KV blocks run low there are four answers, each used here:
- defer:     a waiting request is admitted only if all its tokens fit with a watermark of
             free blocks left over; otherwise it waits (no thrashing);
- reject:    past `max_queued_requests` / `max_queued_tokens`, `check_capacity` raises
             EngineOverloaded instead of letting the queue grow without bound;
- recompute: a preempted sequence frees its blocks and goes back to waiting with its
             generated tokens kept, to be recomputed like a prompt (prefix caching often
             makes that cheap);
- swap:      a preempted sequence's blocks are copied to a host pool and copied back later.
`preemption_mode="auto"` swaps when the host pool has room and the sequence is at least
`swap_min_tokens` long (recompute would cost more than the copy), else recomputes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .block_manager import BlockManager
from .config import EngineConfig
from .errors import EngineOverloaded
from .policy import Policy, make_policy
from .scheduler_output import SchedulerOutput, SchedulerStats
from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.policy: Policy = make_policy(config)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.watermark_blocks = int(config.watermark * block_manager.num_blocks)
        self.counters = SchedulerStats()
        self.last_output = SchedulerOutput()

    # -- queues ---------------------------------------------------------------------------
    def check_capacity(self, num_tokens: int, count: bool = True, pending_requests: int = 0,
                       pending_tokens: int = 0) -> None:
        """Raise EngineOverloaded if one more request of `num_tokens` would pass a queue limit.
        `count=False` only looks (for a pre-check from another thread, which also counts the
        `pending_*` requests it has sent that the engine has not queued yet)."""
        cfg = self.config
        waiting = len(self.waiting) + pending_requests
        if waiting >= cfg.max_queued_requests:
            self.counters.rejections += count
            raise EngineOverloaded(f"engine overloaded: {waiting} requests already queued "
                                   f"(max_queued_requests={cfg.max_queued_requests})", limit="max_queued_requests")
        queued = sum(s.num_tokens for s in list(self.waiting)) + pending_tokens
        if queued + num_tokens > cfg.max_queued_tokens:
            self.counters.rejections += count
            raise EngineOverloaded(f"engine overloaded: {queued} tokens already queued "
                                   f"(max_queued_tokens={cfg.max_queued_tokens})", limit="max_queued_tokens")

    def add(self, seq: Sequence) -> None:
        self.policy.on_add(seq, self.backlogged_tenants)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def backlogged_tenants(self) -> set[str | None]:
        return {s.tenant for q in (self.waiting, self.running, self.swapped) for s in q}

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` for `reason`, wherever it is, and free its blocks now."""
        queue = {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting,
                 SequenceStatus.SWAPPED: self.swapped}.get(seq.status)
        if queue is not None:
            queue.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        self.bm.end_step()                                   # last step's swap copies are done
        self._expire(now, out)
        key = lambda s: self.policy.key(s, now)  # noqa: E731
        self.running.sort(key=key)
        budget = self.config.max_num_batched_tokens

        if not self.config.chunked_prefill:
            # Prefill-first, unchunked (vLLM v0 style, kept for comparison): a step that can
            # admit new prompts runs only those, and the decodes wait.
            budget = self._admit(out, budget, now)
            if out.seqs:
                return self._done(out)

        # 1. Decode: every running sequence with one token to compute, most urgent first.
        for seq in [s for s in self.running if not s.is_prefill]:
            if seq.status is SequenceStatus.RUNNING and self._reserve_decode_slot(seq, out, now):
                out.add(seq, 1)
                budget -= 1
        # 2. Ongoing prefills (chunked), in urgency order.
        for seq in [s for s in self.running if s.is_prefill]:
            n = self._chunk(seq.num_uncomputed_tokens, budget)
            if n == 0:
                break
            self._add(out, seq, n)
            budget -= n
        # 3. Swapped-out sequences come back, then new requests are admitted.
        self._admit(out, budget, now)
        return self._done(out)

    def _done(self, out: SchedulerOutput) -> SchedulerOutput:
        self.last_output = out
        return out

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        """Requests past their deadline: dropped before prefill if still waiting, finished
        with 'deadline' otherwise; blocks freed now."""
        for queue in (self.waiting, self.swapped, self.running):
            for seq in [s for s in queue if s.deadline is not None and s.deadline <= now]:
                if seq.status is SequenceStatus.WAITING and seq.num_output_tokens == 0:
                    self.counters.deadline_drops += 1
                else:
                    self.counters.deadline_finishes += 1
                self.finish(seq, "deadline")
                out.finished.append(seq)

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Swap in and admit, most urgent first, while budget, seats and blocks allow.
        Static batching (for comparison) admits only until the batch's first token, then
        runs the batch to completion before the next one starts."""
        if self.config.batching == "static" and any(s.num_output_tokens > 0 for s in self.running):
            return budget
        if len(self.running) >= self.config.max_num_seqs and not self.config.priority_preemption:
            return budget                                    # no seat can open this step
        key = lambda s: self.policy.key(s, now)  # noqa: E731
        self.waiting.sort(key=key)
        self.swapped.sort(key=key)
        while budget > 0 and (self.waiting or self.swapped):
            if self.policy.dynamic:                          # keys moved with the last admission
                self.waiting.sort(key=key)
                self.swapped.sort(key=key)
            seq = min(self.waiting[:1] + self.swapped[:1], key=key)
            if seq in out.preempted:
                break                                        # do not undo this step's preemption
            swapping = seq.status is SequenceStatus.SWAPPED
            need = seq.num_uncomputed_tokens if swapping else seq.num_tokens
            if self._chunk(need, budget) == 0 or not self._make_room(seq, swapping, out, now):
                break
            if swapping:
                self.swapped.remove(seq)
                pairs = self.bm.swap_in(seq)
                out.swap_in += pairs
                self.counters.swapped_in_blocks += len(pairs)
            else:
                self.waiting.remove(seq)
                self.bm.allocate(seq)
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = self._chunk(seq.num_uncomputed_tokens, budget)
            self._add(out, seq, n)
            budget -= n
        return budget

    def _add(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """Schedule `n` tokens of `seq`. Prompt work is charged to the policy now (as VTC
        does at admission), so the next pick in this same step already sees it; output
        tokens are charged when they are sampled."""
        out.add(seq, n)
        if seq.computes_prompt:
            self.policy.on_served(seq, n, 0)

    def _fits(self, seq: Sequence, swapping: bool) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        reserve = self.watermark_blocks
        return self.bm.can_swap_in(seq, reserve) if swapping else self.bm.can_allocate(seq, reserve)

    def _make_room(self, seq: Sequence, swapping: bool, out: SchedulerOutput, now: float) -> bool:
        """Whether `seq` can start now; with preemption at admission on, it may preempt
        running sequences the policy lets it displace (a less urgent class under `priority`,
        a tenant holding more than its share of seats under `fair`)."""
        if self._fits(seq, swapping):
            return True
        if not self.config.priority_preemption:
            return False
        lower = [s for s in self.running if self.policy.may_preempt(s, seq, now, self.running)]
        lower.sort(key=lambda s: self.policy.victim_key(s, now), reverse=True)
        # Preempt only if giving up all of them would be enough: never lose work for nothing.
        need = self.bm.blocks_for(seq.num_tokens) if swapping else self.bm.blocks_needed(seq)
        freeable = sum(self.bm.num_exclusive_blocks(s) for s in lower)
        seats = self.config.max_num_seqs - len(self.running) + len(lower)
        if seats < 1 or need + self.watermark_blocks > self.bm.num_free_blocks + freeable:
            return False
        for victim in lower:
            out.remove(victim)
            self._preempt(victim, out)
            if self._fits(seq, swapping):
                return True
        return False

    def _chunk(self, left: int, budget: int) -> int:
        """Tokens to compute this step: all that is left, or a chunk of the budget."""
        if not self.config.chunked_prefill:
            return left if left <= budget else 0
        return min(left, budget)

    def _reserve_decode_slot(self, seq: Sequence, out: SchedulerOutput, now: float) -> bool:
        """Find a KV slot for `seq`'s next token, preempting less urgent sequences if needed.
        Returns False if `seq` itself had to be preempted."""
        while not self.bm.can_append(seq, 1):
            scheduled = {id(s) for s in out.seqs}
            candidates = [s for s in self.running if id(s) not in scheduled]
            victim = max(candidates, key=lambda s: self.policy.victim_key(s, now))
            if self.policy.urgency(victim, now) < self.policy.urgency(seq, now):
                victim = seq                                 # never preempt a more urgent one
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.bm.append_slots(seq, 1)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        mode = self.config.preemption_mode
        swap = self.bm.can_swap_out(seq) and (
            mode == "swap" or (mode == "auto" and seq.num_computed_tokens >= self.config.swap_min_tokens))
        if swap:
            pairs = self.bm.swap_out(seq)
            out.swap_out += pairs
            self.counters.preemptions_swap += 1
            self.counters.swapped_out_blocks += len(pairs)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.counters.preemptions_recompute += 1
            self.counters.recomputed_tokens += seq.num_computed_tokens
            self.bm.free(seq)                               # tokens kept: recomputed as a prompt
            seq.status = SequenceStatus.WAITING
            self.waiting.insert(0, seq)
