"""Token sampling: greedy, temperature, top-k, top-p, with a per-request RNG so the same
seed gives the same output regardless of what else is in the batch."""

from __future__ import annotations

import random

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [K, V] float32, one row per sequence in `seqs`. Returns one token id each."""
    tokens = logits.argmax(dim=-1)                                   # [K] greedy for all
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        params = [seqs[i].params for i in rows]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        probs = _filtered_probs(logits[idx] / temps[:, None],
                                torch.tensor([p.top_k for p in params], device=logits.device),
                                torch.tensor([p.top_p for p in params], device=logits.device))  # [R, V]
        cdf = probs.cumsum(dim=-1)                                   # [R, V]
        for j, i in enumerate(rows):
            gen = _generator(seqs[i], logits.device)
            # Inverse CDF, one uniform draw per row: the first token whose cumulative mass
            # exceeds u * total (never a zero-probability one). An exponential race over the
            # vocabulary cost ~2.5 ms a row (a scalar log per token).
            u = torch.rand((), generator=gen, device=logits.device) * cdf[j, -1]
            tokens[i] = torch.searchsorted(cdf[j], u[None], right=True).clamp_(max=cdf.shape[1] - 1)[0]
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Softmax over the tokens that survive each row's top-k and top-p cuts. [R, V]

    Without any cut (top_k 0, top_p 1: the default) it is the plain softmax; sorting the
    vocabulary for nothing was ~10 ms of a 40 ms SmolLM2 decode step. With top-k only the
    largest k are ranked (topk), and the whole vocabulary only when some row has top-p alone."""
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    if bool((k == vocab).all()) and bool((top_p >= 1.0).all()):
        return logits.softmax(dim=-1)
    ranked = vocab if bool((top_p < 1.0).any()) else int(k.max())
    if ranked < vocab:
        sorted_logits, order = logits.topk(ranked, dim=-1)               # [R, ranked], descending
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)      # [R, V]
    ranks = torch.arange(ranked, device=logits.device)[None, :]
    cut = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
    cut |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def _generator(seq: Sequence, device: torch.device) -> torch.Generator:
    if seq.generator is None:
        seed = seq.params.seed if seq.params.seed is not None else random.getrandbits(63)
        seq.generator = torch.Generator(device=device).manual_seed(seed)
    return seq.generator
