"""Scheduling policies: one ordering rule each.

`key(seq, now)` orders the waiting queue and the running batch (smaller is served first);
`victim_key(seq, now)` orders preemption victims (larger is preempted first: least urgent,
then least progress, i.e. cheapest to redo).
"""

from __future__ import annotations

from .config import EngineConfig
from .sequence import Sequence


class Policy:
    name = "base"

    def key(self, seq: Sequence, now: float) -> tuple:
        raise NotImplementedError

    def victim_key(self, seq: Sequence, now: float) -> tuple:
        return (self.key(seq, now), -seq.num_computed_tokens)


class FCFS(Policy):
    """First come, first served: arrival order."""

    name = "fcfs"

    def key(self, seq: Sequence, now: float) -> tuple:
        return (seq.arrival_time,)


_POLICIES: dict[str, type[Policy]] = {"fcfs": FCFS}


def make_policy(config: EngineConfig) -> Policy:
    try:
        return _POLICIES[config.policy]()
    except KeyError:
        raise ValueError(f"EngineConfig.policy: {config.policy!r} is not implemented yet "
                         f"(available: {sorted(_POLICIES)})") from None
