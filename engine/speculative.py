"""Speculative decoding without a draft model: n-gram (prompt-lookup) proposals.

Each decoding sequence proposes up to `num_speculative_tokens` tokens from its own history
(prompt and output): the longest suffix of n tokens (n from `speculative_ngram_max` down to
`speculative_ngram_min`) that occurred before is looked up, and the tokens that followed
its most recent occurrence are proposed (vLLM's `ngram` method, llama.cpp's lookup
decoding). A continuation that runs into the present repeats it periodically, so a
sequence stuck in a loop of period d proposes the whole loop, not d tokens. With
`speculative_history_tokens`, the tenant's finished requests propose too, where they match a
longer suffix (ngram_history.py).

The scheduler (`Speculator.extend`, after decodes, prefills and admissions, from the budget
they leave: a prompt is never delayed by proposals) turns a decode entry [last token] into
[last token, d1 .. dk]; the runner returns logits at all k+1 positions and spec_decode.py
keeps the longest prefix the model agrees with plus one token of its own. A sequence
without a proposal stays an ordinary one-token decode, so a batch without proposals runs
exactly the plain step.

Adaptive: each sequence keeps an average of its recent acceptance (accepted / proposed,
weight 1/2 on the last verification); below `speculative_min_acceptance` it stops proposing
for a back-off of 4 decode steps, doubling (to 256) each time it fails again, and resets when
it accepts well. With `speculative_disable_by_batch_size` (vLLM's flag), a step that decodes
more sequences than that proposes nothing: wide steps are compute-bound, and there verifying
drafts costs more than it saves. Plain sampling or a grammar: rows with penalties, logit
bias, min-p or logprobs never propose (their next distribution depends on the tokens before
it through more than the model and the grammar). A grammar-constrained row proposes what its grammar
forces next (llguidance's fast-forward tokens, the jump-forward of structured output) or
else its n-gram proposal, cut where the grammar would refuse it (grammar_runtime.py's
`GrammarState.drafts`); verification masks each position by the grammar's state after the
drafts before it (spec_decode.py). Plain ints only; never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import EngineConfig, SamplingParams
from .ngram_history import NgramHistory, grams
from .sequence import Sequence

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .scheduler_output import SchedulerOutput

_FIRST_BACKOFF = 4
_MAX_BACKOFF = 256


class NgramIndex:
    """Every n-gram (n in [lo, hi]) of a growing token list -> the index of its most recent
    last token. Append-only, as a sequence's committed tokens are."""

    __slots__ = ("lo", "hi", "last", "upto", "matched")

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.last: dict[tuple[int, ...], int] = {}
        self.upto = 0                      # n-grams ending before this index are indexed
        self.matched = 0                   # the last proposal's n (0: none)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the longest
        matching suffix of `tokens` ([] if none matches)."""
        for key, i in grams(tokens, self.lo, self.hi, self.upto):    # those before the suffix's end
            self.last[key] = i
        self.upto = max(self.upto, len(tokens) - 1)
        self.matched = 0
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            at = self.last.get(tuple(tokens[len(tokens) - n:]))
            if at is not None:
                self.matched = n
                out: list[int] = []
                for j in range(at + 1, at + 1 + k):      # past the end: the proposal itself
                    out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
                return out
        return []


class SpecState:
    """One sequence's proposer and its recent acceptance."""

    __slots__ = ("index", "acceptance", "backoff", "skip")

    def __init__(self, lo: int, hi: int):
        self.index = NgramIndex(lo, hi)
        self.acceptance = 1.0
        self.backoff = _FIRST_BACKOFF
        self.skip = 0                      # decode steps left without proposals


def plain_sampling(params: SamplingParams) -> bool:
    """The row samples from the model's distribution alone, or masked by a grammar
    (logits_processors.needs_processing is False but for the grammar): what verification in
    spec_decode.py handles."""
    return not (params.logit_bias or params.repetition_penalty != 1.0 or params.frequency_penalty
                or params.presence_penalty or params.min_p > 0.0 or params.logprobs is not None)


class Speculator:
    def __init__(self, config: EngineConfig):
        self.k = config.num_speculative_tokens
        self.lo, self.hi = config.speculative_ngram_min, config.speculative_ngram_max
        self.min_acceptance = config.speculative_min_acceptance
        self.max_rows = config.speculative_disable_by_batch_size
        self.history = (NgramHistory(config.speculative_history_tokens, self.lo, self.hi)
                        if self.k and config.speculative_history_tokens else None)
        self.proposed_tokens = 0           # drafts verified
        self.accepted_tokens = 0           # drafts the model agreed with
        self.verified_rows = 0             # decode entries that carried drafts

    def extend(self, out: SchedulerOutput, bm: BlockManager, reserve: int, max_model_len: int) -> None:
        """Add proposals to the step's decode entries while the budget (what decodes,
        prefills and admissions left) and free KV blocks (beyond `reserve`, shared by every KV
        group's table) allow."""
        if not self.k or (self.max_rows is not None and out.num_decode_tokens > self.max_rows):
            return
        for i, seq in enumerate(out.seqs):
            left = out.budget_left
            if left <= 0:
                return
            if not (out.is_decode[i] and out.samples[i]) or seq.computes_prompt or not seq.can_sample \
                    or not plain_sampling(seq.params):
                continue
            # Every KV group's table grows by the same blocks (kv_groups.py), out of one pool.
            free = (bm.num_free_blocks - reserve) // bm.num_groups
            room = (len(seq.block_table) + free) * bm.block_size - seq.num_tokens
            k = min(self.k, left, room, seq.params.max_tokens - seq.num_output_tokens - 1,
                    max_model_len - seq.num_tokens - 1)
            drafts = self._propose(seq, k) if k > 0 else []
            if drafts:
                out.add_drafts(i, drafts)
                bm.append_slots(seq, 1 + len(drafts))

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        state = seq.spec_state
        if state is None:
            state = seq.spec_state = SpecState(self.lo, self.hi)
        if state.skip:
            state.skip -= 1
            return []
        if seq.grammar_state is not None:                  # grammar_runtime.GrammarState.drafts
            return seq.grammar_state.drafts(seq.output_token_ids, lambda: self._ngrams(seq, state, k), k)
        return self._ngrams(seq, state, k)

    def _ngrams(self, seq: Sequence, state: SpecState, k: int) -> list[int]:
        """The sequence's own n-gram proposal, or its tenant's history's (ngram_history.py)
        where that matched a longer suffix."""
        tokens = seq.token_ids()
        drafts = state.index.propose(tokens, k)
        if self.history is not None and state.index.matched < self.hi:
            more = self.history.propose(seq.tenant, tokens, k, longer_than=state.index.matched)
            drafts = more or drafts
        return drafts

    def retire(self, seq: Sequence) -> None:
        """A finished sequence's answer (with the end of its prompt, so that the answer's first
        tokens are found after it) joins its tenant's history."""
        if self.history is not None and seq.output_token_ids:
            self.history.add(seq.tenant, seq.prompt_token_ids[-self.hi:] + seq.output_token_ids)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verification's result: counters, and the sequence's back-off."""
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.verified_rows += 1
        state = seq.spec_state
        state.acceptance = 0.5 * state.acceptance + 0.5 * accepted / proposed
        if state.acceptance < self.min_acceptance:
            state.skip = state.backoff
            state.backoff = min(_MAX_BACKOFF, 2 * state.backoff)
            state.acceptance = 0.5                          # one more bad verification turns it off again
        elif accepted == proposed:
            state.backoff = _FIRST_BACKOFF

    def stats(self) -> dict:
        return {"spec_draft_tokens": self.proposed_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_verified_rows": self.verified_rows,
                "spec_acceptance_rate": self.accepted_tokens / max(1, self.proposed_tokens)}
