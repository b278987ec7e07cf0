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
        for j, i in enumerate(rows):
            gen = _generator(seqs[i], logits.device)
            # Exponential race: argmax(p / E), E ~ Exp(1), samples from p (one draw per row).
            noise = torch.empty_like(probs[j]).exponential_(generator=gen)
            tokens[i] = (probs[j] / noise).argmax()
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Softmax over the tokens that survive each row's top-k and top-p cuts. [R, V]"""
    sorted_logits, order = logits.sort(dim=-1, descending=True)      # [R, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
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
