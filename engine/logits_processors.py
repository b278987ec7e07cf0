"""The logits processors of the OpenAI/vLLM sampling surface (issue 27), applied per row in
this order, which is vLLM v1's:

1. logit_bias: the bias is added to each named token's logit;
2. repetition_penalty (HF/vLLM): a logit of a token in the prompt or the output so far is
   divided by the penalty if positive, multiplied by it otherwise;
3. frequency_penalty and presence_penalty (OpenAI): logit - frequency * count - presence * (count > 0),
   count over the generated tokens only;
4. the grammar's mask (grammar_runtime.py): disallowed tokens to -inf (applied first in
   fact: -inf stays -inf through steps 1-3, so the order is the same result);
then, in sampler.py, temperature, min_p (on the tempered distribution, as vLLM), top-k and top-p.

The processed distribution (everything above) is the one sampled from and the one whose
log-probabilities are reported (vLLM's `processed_logprobs`); greedy rows skip temperature
and the cuts, so theirs is the log-softmax of the processed logits.
"""

from __future__ import annotations

import torch

from .config import SamplingParams
from .sequence import Sequence, TokenLogprob


def needs_processing(params: SamplingParams) -> bool:
    """Whether a row leaves the plain (pre-issue-27) sampling path."""
    return bool(params.logit_bias or params.repetition_penalty != 1.0 or params.frequency_penalty
                or params.presence_penalty or params.min_p > 0.0 or params.logprobs is not None
                or params.grammar is not None)


def apply_penalties(x: torch.Tensor, seqs: list[Sequence]) -> None:
    """Steps 1-3 on `x` [R, V] in place, row j for seqs[j]."""
    dev, vocab = x.device, x.shape[-1]
    for j, seq in enumerate(seqs):
        p = seq.params
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=dev)
            x[j].index_add_(0, ids, torch.tensor([float(b) for _, b in p.logit_bias], device=dev, dtype=x.dtype))
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            seen[torch.tensor(seq.prompt_token_ids + seq.output_token_ids, device=dev)] = True
            row = x[j]
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            x[j] = torch.where(seen, penalised, row)
        if (p.frequency_penalty or p.presence_penalty) and seq.output_token_ids:
            counts = torch.bincount(torch.tensor(seq.output_token_ids, device=dev), minlength=vocab)[:vocab]
            x[j] -= counts.to(x.dtype) * p.frequency_penalty + (counts > 0).to(x.dtype) * p.presence_penalty


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability under softmax(x) is below min_p * the largest are set to -inf. [R, V]"""
    if not bool((min_p > 0).any()):
        return x
    probs = x.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(~keep, float("-inf"))


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], ks: list[int | None]) -> list[TokenLogprob | None]:
    """Per row: the chosen token's log-probability and the top k (finite ones only: a token
    the grammar or a cut excludes is never listed), from `logprobs` [R, V]."""
    out: list[TokenLogprob | None] = [None] * len(tokens)
    rows = [j for j, k in enumerate(ks) if k is not None]
    if not rows:
        return out
    kmax = max(ks[j] for j in rows)
    chosen = logprobs[rows, [tokens[j] for j in rows]].tolist()
    if kmax:
        values, ids = logprobs[rows].topk(kmax, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    for n, j in enumerate(rows):
        top = ()
        if ks[j]:
            top = tuple((i, v) for i, v in zip(ids[n][:ks[j]], values[n][:ks[j]]) if v != float("-inf"))
        out[j] = TokenLogprob(tokens[j], chosen[n], top)
    return out
