"""Prompt logprobs (SamplingParams.prompt_logprobs): the log-probability of each prompt token
given the ones before it, and the top k alternatives, from the prefill's own logits.

The logits at position p predict token p + 1, so a chunk computing positions [start, end)
yields prompt tokens start + 1 .. end (the prompt's last position predicts the first output
token: it is sampled, not recorded). `rows(batch)` names, per batch entry, the positions
whose logits the runner keeps beside the sampled rows — its rows come after them (and after
speculative drafts' rows, spec_decode.py), in this
order — and `record` turns those logits into `Sequence.prompt_logprobs`, which starts as
[None] (the first token has no context). Positions already recorded are never asked again,
so a sequence recomputed after preemption records nothing twice. A request asking for them
skips the prefix cache (block_manager.py): cached positions have no logits (as in vLLM).

The distribution is the model's (log-softmax of its logits: no temperature, penalties or
grammar), as vLLM reports prompt logprobs.
"""

from __future__ import annotations

import torch

from .logits_processors import token_logprobs
from .scheduler_output import SchedulerOutput


def rows(batch: SchedulerOutput) -> list[tuple[int, int, int]]:
    """(batch entry, first row offset within its chunk, count) for each entry whose chunk
    covers prompt positions not recorded yet; computed before the step's update."""
    out = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        done = seq.prompt_logprobs
        if done is None:
            continue
        start = seq.num_computed_tokens
        lo = max(start, len(done) - 1)                     # position p records token p + 1
        hi = min(start + n, seq.num_prompt_tokens - 1)
        if hi > lo:
            out.append((i, lo - start, hi - lo))
    return out


def record(batch: SchedulerOutput, plan: list[tuple[int, int, int]], logits: torch.Tensor) -> None:
    """Append each planned entry's prompt logprobs; `logits` [sum of counts, V] in plan order."""
    at = 0
    for i, offset, count in plan:
        seq = batch.seqs[i]
        first = seq.num_computed_tokens + offset + 1       # the first token these rows predict
        targets = seq.prompt_token_ids[first:first + count]
        logprobs = logits[at:at + count].float().log_softmax(dim=-1)     # [count, V]
        seq.prompt_logprobs += token_logprobs(logprobs, targets, [seq.params.prompt_logprobs] * count)
        at += count
