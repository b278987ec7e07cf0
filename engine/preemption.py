"""Preemption: taking KV room or a seat back from running sequences (mixed into the
Scheduler, whose queues and counters it changes).

- For KV room (`_reserve_decode_slot`): a decode that cannot get its next slot preempts
  the least urgent running sequence not yet scheduled this step, or itself if every other
  one is more urgent.
- For a seat (`_make_room`, preemption at admission): an arrival may displace running
  sequences the policy lets it claim (`Policy.may_preempt`: a lower class under
  `priority`; under `fair`, a tenant VTC serves first, or one holding no seat from a
  tenant over its seat share). Churn is bounded: a sequence keeps its seat for
  `seat_quantum_steps` after (re)admission and loses it at most `max_seat_preemptions`
  times, and nothing is preempted unless all the candidates together would make enough
  room.
- How (`_preempt`): recompute (free the blocks, requeue first, tokens kept) or swap to the
  host pool, whichever `_swap_is_cheaper` says; a victim scheduled earlier in this step is
  taken back first, its tokens returned to the budget and its prompt charge refunded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .scheduler_output import SchedulerOutput
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .config import EngineConfig
    from .policy import Policy
    from .scheduler_output import SchedulerStats


class Preemption:
    config: EngineConfig
    bm: BlockManager
    policy: Policy
    counters: SchedulerStats
    running: list[Sequence]
    waiting: list[Sequence]
    swapped: list[Sequence]
    watermark_blocks: int
    num_steps: int

    def _fits(self, seq: Sequence, swapping: bool) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        reserve = self.watermark_blocks
        return self.bm.can_swap_in(seq, reserve) if swapping else self.bm.can_allocate(seq, reserve)

    def _take_back(self, out: SchedulerOutput, seq: Sequence) -> None:
        """Undo `seq`'s entry in this step, if any: its tokens return to the budget (the
        budget is what the entries leave) and its prompt charge is refunded."""
        taken = out.remove(seq)
        if taken is not None and taken[1]:
            seq.num_billed_tokens -= taken[1]
            self.policy.on_served(seq, -taken[1], 0)

    def _may_lose_seat(self, seq: Sequence) -> bool:
        """Not before it has run its quantum since (re)admission, and not too often."""
        ran = self.num_steps - (seq.admitted_step or 0)
        return ran >= self.config.seat_quantum_steps and seq.num_seat_preemptions < self.config.max_seat_preemptions

    def _make_room(self, seq: Sequence, swapping: bool, out: SchedulerOutput, now: float, claim: bool = False) -> bool:
        """Whether `seq` can start now; with preemption at admission on, it may preempt
        running sequences the policy lets it displace (a less urgent class under `priority`;
        under `fair`, another tenant's, by service or by seat share). With `claim`, only if
        it has such a claim (it is being let past a head that could not start)."""
        if not claim and self._fits(seq, swapping):
            return True
        if not self.config.priority_preemption:
            return False
        lower = [s for s in self.running
                 if self._may_lose_seat(s) and self.policy.may_preempt(s, seq, now, self.running)]
        if claim and not lower:
            return False
        if self._fits(seq, swapping):
            return True
        lower.sort(key=lambda s: self.policy.victim_key(s, now), reverse=True)
        # Preempt only if giving up all of them would be enough: never lose work for nothing.
        need = self.bm.swap_in_need(seq) if swapping else self.bm.blocks_needed(seq)
        freeable = sum(self.bm.num_exclusive_blocks(s) for s in lower)
        seats = self.config.max_num_seqs - len(self.running) + len(lower)
        if seats < 1 or need + self.watermark_blocks > self.bm.num_free_blocks + freeable:
            return False
        for victim in lower:
            self._take_back(out, victim)
            self._preempt(victim, out, for_seat=True)
            if self._fits(seq, swapping):
                return True
        return False

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

    def _preempt(self, seq: Sequence, out: SchedulerOutput, for_seat: bool = False) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        seq.num_seat_preemptions += for_seat
        self.counters.seat_preemptions += for_seat
        out.preempted.append(seq)
        if self._swap_is_cheaper(seq, for_seat):
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

    def _swap_is_cheaper(self, seq: Sequence, for_seat: bool) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.bm.can_swap_out(seq):
            return False
        if mode == "swap":
            return True
        redo = seq.num_computed_tokens
        if for_seat and self.bm.enable_prefix_caching:      # the pool is not short: its blocks stay cached
            redo -= len(seq.block_hashes) * self.bm.block_size
        return redo >= self.config.swap_min_tokens
