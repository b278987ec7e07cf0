"""What one scheduling step decided, and the scheduler's running counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class SchedulerOutput:
    """One step's batch (decode entries first, then prefill chunks), the KV copies the
    runner must do before the forward pass, and requests ended by the scheduler.

    Per entry i, computed once when the entry is added, so nobody re-derives them:
    `samples[i]`   the chunk reaches the sequence's last token: its row is sampled;
    `is_decode[i]` exactly one token to compute and it is the last one (a decode);
    `charged[i]`   prompt tokens billed to the tenant for this entry (refunded if the
                   entry is taken back; recomputed tokens are never billed twice);
    `drafts[i]`    speculative tokens proposed after a decode's last token (speculative.py):
                   the entry computes [last token, *drafts] and all those rows are verified.
    """

    token_budget: int = 0
    capped_prompt_tokens: int = 0     # prompt tokens scheduled under a Policy.prompt_cap
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)
    computes_prompt: list[bool] = field(default_factory=list)
    charged: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)    # e.g. deadline passed
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host block, device block)

    def add(self, seq: Sequence, n: int, charged: int = 0) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.samples.append(seq.num_computed_tokens + n == seq.num_tokens)
        self.is_decode.append(seq.num_uncomputed_tokens == 1)
        self.computes_prompt.append(seq.computes_prompt)
        self.charged.append(charged)
        self.drafts.append([])

    def add_drafts(self, i: int, drafts: list[int]) -> None:
        """Entry i (a decode) also computes `drafts` after its last token."""
        self.num_new_tokens[i] += len(drafts)
        self.drafts[i] = drafts

    def remove(self, seq: Sequence) -> tuple[int, int] | None:
        """Take back a sequence scheduled earlier in this step (it is being preempted);
        returns its (tokens, charged prompt tokens), or None if it was not scheduled."""
        for i, s in enumerate(self.seqs):
            if s is seq:
                taken = self.num_new_tokens[i], self.charged[i]
                for entries in (self.seqs, self.num_new_tokens, self.samples, self.is_decode,
                                self.computes_prompt, self.charged, self.drafts):
                    del entries[i]
                return taken
        return None

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences whose row is sampled, in batch order (the runner's logits order),
        but those with drafts (`drafted`, whose rows follow)."""
        return [s for s, sample, d in zip(self.seqs, self.samples, self.drafts) if sample and not d]

    @property
    def drafted(self) -> list[tuple[Sequence, list[int]]]:
        """(sequence, drafts) of the entries that verify proposals, in batch order."""
        return [(s, d) for s, d in zip(self.seqs, self.drafts) if d]

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def budget_left(self) -> int:
        return self.token_budget - self.num_batched_tokens

    @property
    def num_decode_tokens(self) -> int:
        return sum(self.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens


@dataclass
class SchedulerStats:
    """Cumulative counters (seed 000's list)."""

    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    seat_preemptions: int = 0     # of those, to give an arrival its seat (fair / priority)
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    deadline_drops: int = 0       # expired while waiting, before any output
    deadline_finishes: int = 0    # expired after starting
    rejections: int = 0           # EngineOverloaded raised
    prompt_tokens: int = 0        # prompt tokens computed, recompute included
    generation_tokens: int = 0    # output tokens sampled
    served: dict = field(default_factory=dict)   # tenant -> [billed input tokens, output tokens]

    @property
    def preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap
