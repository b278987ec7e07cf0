"""What one scheduling step decided, and the scheduler's running counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class SchedulerOutput:
    """One step's batch (decode entries first, then prefill chunks), the KV copies the
    runner must do before the forward pass, and requests ended by the scheduler."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decode_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)    # e.g. deadline passed
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host block, device block)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        if seq.num_uncomputed_tokens == 1:
            self.num_decode_tokens += 1

    def remove(self, seq: Sequence) -> None:
        """Take back a sequence scheduled earlier in this step (it is being preempted)."""
        for i, s in enumerate(self.seqs):
            if s is seq:
                if seq.num_uncomputed_tokens == 1:
                    self.num_decode_tokens -= 1
                del self.seqs[i], self.num_new_tokens[i]
                return

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens


@dataclass
class SchedulerStats:
    """Cumulative counters (seed 000's list)."""

    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    deadline_drops: int = 0       # expired while waiting, before any output
    deadline_finishes: int = 0    # expired after starting
    rejections: int = 0           # EngineOverloaded raised

    @property
    def preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap
