"""Iteration-level scheduler: each step re-forms the batch.

One rule: each step, a sequence's computed tokens catch up with its tokens, under a token
budget (budget.py: fixed, or adapted to an inter-token latency target) and a sequence cap
(`max_num_seqs`). Running sequences
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
`preemption_mode="auto"` swaps when recomputing would redo at least `swap_min_tokens`
tokens and the host pool has room (docs/ENGINE.md: seats, and what counts as redone).
Preemption itself, for KV room and for seats at admission, is preemption.py.

After the forward pass `update()` owns everything: computed tokens catch up, full blocks
are committed, sampled tokens are appended and charged, stop tokens, stop strings and
lengths finish.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from .admission import make_admission
from .block_manager import BlockManager
from .budget import make_budget
from .config import EngineConfig
from .errors import EngineOverloaded
from .policy import Policy, make_policy
from .port import check_capacity
from .preemption import Preemption
from .scheduler_output import SchedulerOutput, SchedulerStats
from .sequence import Sequence, SequenceStatus
from .speculative import Speculator


class Scheduler(Preemption):
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic, max_model_len: int | None = None):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.max_model_len = max_model_len or config.max_model_len or 2**62
        self.policy: Policy = make_policy(config)
        self.admission = make_admission(config)
        self.budget = make_budget(config)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.watermark_blocks = int(config.watermark * block_manager.num_blocks)
        self.counters = SchedulerStats()
        self.speculator = Speculator(config)                 # n-gram proposals (off unless configured)
        self.last_output = SchedulerOutput()
        self.num_steps = 0

    # -- queues ---------------------------------------------------------------------------
    def check_capacity(self, num_tokens: int) -> None:
        """Raise EngineOverloaded, counted as a rejection, if one more request of
        `num_tokens` would pass a queue limit (engine thread: the check that decides)."""
        try:
            check_capacity(self.config, len(self.waiting), self.queued_tokens(), num_tokens)
        except EngineOverloaded:
            self.counters.rejections += 1
            raise

    def queued_tokens(self) -> int:
        return sum(s.num_tokens for s in self.waiting)

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
        self.speculator.retire(seq)

    # -- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self.num_steps += 1
        out = SchedulerOutput()
        self.bm.end_step()                                   # last step's swap copies are done
        self._expire(now, out)
        self.running.sort(key=lambda s: self.policy.key(s, now))
        out.token_budget = self.budget.tokens(sum(1 for s in self.running if not s.is_prefill))
        if not self.admission.prompts_alone(self, out, now):
            self._schedule_decodes(out, now)
            self._schedule_prefills(out, now)
            self.admit(out, now)
            self.speculator.extend(out, self.bm, self.watermark_blocks, self.max_model_len)
        self.last_output = out
        return out

    def update(self, batch: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """After the forward pass: computed tokens catch up and full blocks are committed;
        each sampling sequence gets its token, charged to its tenant, and its text
        (`seq.new_text`, from its detokenizer), and is finished if the token is a stop
        token, the text completed a stop string, its grammar is complete, or the sequence
        reached its length. Every finish_reason but 'abort', 'deadline' and 'error' is decided
        here. Returns the sampling sequences in batch order (finished ones have left the
        queues and freed their blocks). Entries with drafts are left to spec_decode.py, which
        accepts their tokens one by one through append_token."""
        c = self.counters
        for seq, n, prompt, charged, drafts in zip(batch.seqs, batch.num_new_tokens, batch.computes_prompt,
                                                   batch.charged, batch.drafts):
            if drafts:
                continue                                     # verified: caught up token by token (spec_decode.py)
            seq.num_computed_tokens += n
            self.bm.commit(seq)
            c.prompt_tokens += n if prompt else 0
            c.served.setdefault(seq.tenant or "", [0, 0])[0] += charged
        sampling = batch.sampling_seqs
        for seq, token in zip(sampling, sampled, strict=True):
            if seq.params.max_tokens == 0:                   # prompt logprobs only: nothing generated
                self.finish(seq, "length")
                continue
            self.append_token(seq, token)
        return sampling

    def append_token(self, seq: Sequence, token: int) -> None:
        """`seq` gets `token`, charged to its tenant, and its text (`seq.new_text`, from its
        detokenizer); finished with 'stop' on a stop token or a completed stop string (which
        outranks 'length'), else with 'length' when it reached its length."""
        c = self.counters
        seq.output_token_ids.append(token)
        seq.num_billed_tokens = seq.num_tokens               # its position is paid for by the output charge
        self.policy.on_served(seq, 0, 1)
        c.generation_tokens += 1
        c.served.setdefault(seq.tenant or "", [0, 0])[1] += 1
        stop_token = token in seq.params.stop_token_ids or (token in seq.eos_token_ids and not seq.params.ignore_eos)
        detok = seq.detokenizer                              # a stop token's text is never shown
        seq.new_text = "" if stop_token or detok is None else detok.add_token(token)
        if stop_token or (detok is not None and detok.stopped):
            self.finish(seq, "stop")
        elif seq.grammar_state is not None and seq.grammar_state.complete:        # (grammar_runtime.py)
            self.finish(seq, "stop")
        elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, "length")

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

    def _schedule_decodes(self, out: SchedulerOutput, now: float) -> None:
        """Every running sequence with one token to compute, most urgent first."""
        for seq in [s for s in self.running if not s.is_prefill]:
            if seq.status is SequenceStatus.RUNNING and seq.can_sample and self._reserve_decode_slot(seq, out, now):
                self._add(out, seq, 1)                       # (a prompt's last token is charged)

    def _schedule_prefills(self, out: SchedulerOutput, now: float) -> None:
        """Ongoing prefills (chunked), in urgency order."""
        for seq in [s for s in self.running if s.is_prefill]:
            if out.budget_left == 0:
                break
            n = self._chunk(seq, out, self._cap_left(seq, out, now))
            if n:                                            # 0: its class's cap is spent
                self._add(out, seq, n)

    def _cap_left(self, seq: Sequence, out: SchedulerOutput, now: float) -> int | None:
        """What `Policy.prompt_cap` leaves for `seq`'s prompt this step (None: no cap).
        Chunked prefill only: unchunked, a prompt runs whole or not at all."""
        if not (seq.is_prefill and self.config.chunked_prefill):
            return None
        cap = self.policy.prompt_cap(seq, now)
        return None if cap is None else max(0, cap - out.capped_prompt_tokens)

    def _chunk(self, seq: Sequence, out: SchedulerOutput, left: int | None) -> int:
        """Tokens of `seq` to compute this step, counted against what its cap leaves (`left`,
        from `_cap_left`; None: no cap). A victim taken back later in the step does not
        return them: the cap is only under-used for that step."""
        n = self.admission.chunk(seq.num_uncomputed_tokens, out.budget_left)
        if left is None:
            return n
        out.capped_prompt_tokens += min(n, left)
        return min(n, left)

    def admit(self, out: SchedulerOutput, now: float) -> None:
        """Swap in and admit, most urgent first, while budget, seats and blocks allow.
        A head that cannot start does not block the others: after it, a request may still
        start by taking a seat the policy lets it claim (another tenant's beyond its share,
        a lower class), so a flooder's queue or an aged batch request never holds a polite
        or interactive arrival back. Requests of a blocked head's group (tenant and class)
        are not tried again this step. With `isolate_prompts`, a prompt the policy will not
        let share the step of the step's first prompt (`Policy.may_share_step`: under
        `priority`, a less urgent class's) is held for the next step: an interactive first
        token then costs its own prompt's step, not one filled up with the batch class's
        prompts (swap-ins, which compute nothing, still follow)."""
        if not self.admission.is_open(self.running):
            return
        if len(self.running) >= self.config.max_num_seqs and not self.config.priority_preemption:
            return                                           # no seat can open this step
        key = lambda s: self.policy.key(s, now)  # noqa: E731
        group = lambda s: (s.tenant, s.priority)  # noqa: E731
        blocked: set[tuple] = set()                          # heads that could not start
        twins: set[int] = set()                              # prompts whose twin is prefilling: next step
        held: set[tuple] = set()                             # prompts that may not share this step
        first: Sequence | None = None                        # isolate_prompts: the step's first prompt
        self.waiting.sort(key=key)
        self.swapped.sort(key=key)
        while out.budget_left > 0:
            if self.policy.dynamic:                          # keys moved with the last admission
                self.waiting.sort(key=key)
                self.swapped.sort(key=key)
            seq = next((s for s in heapq.merge(self.waiting, self.swapped, key=key)
                        if group(s) not in blocked and group(s) not in held and id(s) not in twins), None)
            if seq is None:
                break
            swapping = seq.status is SequenceStatus.SWAPPED
            if not swapping and self._twin_prefilling(seq):
                twins.add(id(seq))                           # its prompt comes from the prefix cache next
                continue
            if first is not None and not swapping and not self.policy.may_share_step(first, seq):
                held.add(group(seq))                         # its prompt would slow first's token: next step
                continue
            if self.admission.chunk(seq.num_uncomputed_tokens if swapping else seq.num_tokens, out.budget_left) == 0:
                break                                        # the budget is spent (unchunked: for this prompt)
            left = self._cap_left(seq, out, now)             # making room below leaves it unchanged
            if left == 0:
                held.add(group(seq))                         # its class's prompt cap is spent: next step
                continue
            if seq in out.preempted or not self._make_room(seq, swapping, out, now, claim=bool(blocked)):
                if not self.config.priority_preemption:
                    break
                blocked.add(group(seq))
                continue
            if swapping:
                self.swapped.remove(seq)
                pairs = self.bm.swap_in(seq)
                out.swap_in += pairs
                self.counters.swapped_in_blocks += len(pairs)
            else:
                self.waiting.remove(seq)
                self.bm.allocate(seq)
                if self.config.isolate_prompts and first is None:
                    first = seq
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
            seq.status = SequenceStatus.RUNNING
            seq.admitted_step = self.num_steps
            self.running.append(seq)
            self._add(out, seq, self._chunk(seq, out, left))

    def _twin_prefilling(self, seq: Sequence) -> bool:
        """A fresh prompt of at least a block whose exact twin is running and still computing
        its prompt (the `n` choices of one request): it waits for the twin's blocks to be
        committed and takes them from the prefix cache, so the prompt is computed once."""
        if not self.bm.enable_prefix_caching or self.config.batching != "continuous" or seq.num_computed_tokens \
                or seq.num_output_tokens or seq.num_prompt_tokens <= self.bm.block_size:
            return False
        return any(s.num_computed_tokens < s.num_prompt_tokens and s.prompt_token_ids == seq.prompt_token_ids
                   for s in self.running)

    def _add(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """Schedule `n` tokens of `seq`. Prompt work is charged to the policy now (as VTC
        does at admission), so the next pick in this same step already sees it, but only
        for positions never billed before: a recompute after a preemption is free. Output
        tokens are charged when they are sampled."""
        if n and seq.num_computed_tokens + n == seq.num_tokens and not seq.can_sample:
            n -= 1                                           # its grammar is compiling: the sampled token waits
            if n == 0:
                return
        charged = 0
        if seq.computes_prompt:
            end = seq.num_computed_tokens + n
            charged = max(0, end - seq.num_billed_tokens)
            seq.num_billed_tokens += charged
            self.policy.on_served(seq, charged, 0)
        out.add(seq, n, charged)
