"""Token sampling: greedy, temperature, top-k, top-p, with a per-request RNG so the same
seed gives the same output regardless of what else is in the batch.

Rows that use the issue-27 surface (penalties, logit_bias, min_p, logprobs, a grammar) are
sampled apart from the plain rows, through logits_processors.py's steps; a batch without
them runs exactly the plain path (it pays nothing). Either way each row draws one uniform
from its own generator per sampled token, so a seeded request reproduces in any batch.
"""

from __future__ import annotations

import random

import torch

from .logits_processors import apply_min_p, apply_penalties, needs_processing, token_logprobs
from .sequence import Sequence, TokenLogprob


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: the index of its first maximum, as `argmax` gives it (ties to the
    lowest index, a NaN counted the maximum). On the CPU with the kernels loaded,
    csrc/logits.cpp on the step's threads (served, torch's operators run on one: a 32-row
    bf16 step's `max(dim)` took 1.9 ms there); else torch's `max(dim)`, 2.5-3x faster than
    `argmax` on CPU (fp32 [32, 49152] 0.44 against 1.16 ms, 2 threads, Intel AMX host,
    2026-12-04). [K, V] -> [K]"""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] and (op := _argmax_op()) is not None:
        return op(logits if logits.stride(1) == 1 else logits.contiguous())
    return logits.max(dim=-1).indices


_OPS: dict[str, object] = {}


def _op(name: str):
    """torch.ops.streamgate.<name> once the kernels are loaded, else None (asked again next
    time: an engine may load them after the first step of another)."""
    if name not in _OPS:
        try:
            _OPS[name] = getattr(torch.ops.streamgate, name)
        except (AttributeError, RuntimeError):
            return None
    return _OPS[name]


def _argmax_op():
    return _op("argmax_rows")


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [K, V] float32, one row per sequence in `seqs`. Returns one token id each."""
    return sample_step(logits, seqs)[0]


def sample_step(logits: torch.Tensor, seqs: list[Sequence],
                masks: dict[int, torch.Tensor] | None = None) -> tuple[list[int], list[TokenLogprob | None] | None]:
    """Tokens for each row and, where a row asked for them, its log-probabilities (None
    when no row did). `masks`: row -> bool [V] of the tokens its grammar bans."""
    special = [i for i, s in enumerate(seqs) if needs_processing(s.params) or (masks and i in masks)]
    if not special:
        return _plain(logits, seqs), None
    tokens = _plain(logits, seqs, skip=set(special))                 # special rows' entries replaced below
    rows = [seqs[i] for i in special]
    whole = getattr(masks, "banned", None) if masks and list(masks) == special else None
    if whole is not None and len(special) == len(seqs):
        x = logits.masked_fill(whole, float("-inf"))                  # copy and mask in one pass
    else:
        x = logits[special]                                           # a copy: [R, V]
        if whole is not None:
            x.masked_fill_(whole, float("-inf"))
        else:
            for j, i in enumerate(special):
                if masks and i in masks:
                    x[j].masked_fill_(masks[i], float("-inf"))
    apply_penalties(x, rows)
    picked, logprobs = _processed(x, rows)
    out: list[TokenLogprob | None] = [None] * len(seqs)
    for j, i in enumerate(special):
        tokens[i] = picked[j]
    if logprobs is not None:
        for j, lp in enumerate(token_logprobs(logprobs, picked, [s.params.logprobs for s in rows])):
            out[special[j]] = lp
    return tokens, out if any(lp is not None for lp in out) else None


def _plain(logits: torch.Tensor, seqs: list[Sequence], skip: set[int] = frozenset()) -> list[int]:
    """The plain path for every row but those in `skip` (whose generators it leaves alone)."""
    if len(skip) == len(seqs):
        return [0] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy and i not in skip]
    if len(rows) == len(seqs):          # every row draws: no greedy pass, no copy of the rows
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    else:
        tokens = greedy(logits)                                      # [K] greedy for all
    fast = [i for i in rows if drawn_in_kernel(logits, seqs[i].params)]
    if fast:
        tokens[fast] = draw_rows(logits if len(fast) == len(seqs) else logits[fast], [seqs[i] for i in fast])
    kernel_rows = frozenset(fast)
    if slow := [i for i in rows if i not in kernel_rows]:
        sub = logits if len(slow) == len(seqs) else logits[torch.tensor(slow, device=logits.device)]
        _draw(plain_probs(sub, [seqs[i] for i in slow]), [seqs[i] for i in slow], tokens, slow)
    return tokens.tolist()


def drawn_in_kernel(logits: torch.Tensor, params) -> bool:
    """Whether a plain row with these params draws through csrc/logits.cpp's draw_rows (fp32
    logits on the CPU, the kernels loaded, no top-k or top-p cut) rather than torch's softmax and
    cumsum. The same for every row of a sequence, whatever its batch: plain decode rows and
    speculative verification (spec_decode.py) decide alike, so a seed gives the same tokens."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and not params.greedy
            and (params.top_k <= 0 or params.top_k >= logits.shape[-1]) and params.top_p >= 1.0
            and _op("draw_rows") is not None)


def draw_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Row j's token from softmax(logits[j] / temperature) for one uniform from seqs[j]'s
    generator, as `draw` takes it: [R, V] fp32 -> [R] (rows drawn_in_kernel)."""
    dev = logits.device
    u = torch.stack([torch.rand((), generator=_generator(s, dev), device=dev) for s in seqs])
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
    return _op("draw_rows")(logits if logits.stride(-1) == 1 else logits.contiguous(), temps, u)


def plain_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The plain path's distribution for row j of `logits` [R, V] (seqs[j]'s temperature,
    top-k and top-p): what a plain row's token is drawn from. [R, V]"""
    dev = logits.device
    temps = [s.params.temperature for s in seqs]
    # x / 1.0 is x bit for bit: at temperature 1 (the API's default) the [R, V] division is skipped.
    tempered = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=dev)[:, None]
    return _filtered_logits(tempered, torch.tensor([s.params.top_k for s in seqs], device=dev),
                            torch.tensor([s.params.top_p for s in seqs], device=dev)).softmax(dim=-1)


def draw_constrained(x: torch.Tensor, seq: Sequence) -> int:
    """The token of a grammar-constrained row from its masked logits x [V], as sample_step
    draws such a row (the processed path: argmax, or temperature, top-k / top-p and one uniform
    from the request's generator): speculative verification's draw for it (spec_decode.py)."""
    return _processed(x[None], [seq])[0][0]


def _processed(x: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
    """Sample the processed rows `x` [R, V]; returns the tokens and the log-probabilities of
    the distribution each was drawn from (greedy rows: log-softmax of `x`), None if no row
    asked for them."""
    want = any(s.params.logprobs is not None for s in seqs)
    logprobs = x.log_softmax(dim=-1) if want else None
    rows = [j for j, s in enumerate(seqs) if not s.params.greedy]
    tokens = greedy(x) if len(rows) < len(seqs) else torch.zeros(len(seqs), dtype=torch.long, device=x.device)
    if rows:
        params = [seqs[j].params for j in rows]
        dev = x.device
        temps = torch.tensor([p.temperature for p in params], device=dev, dtype=x.dtype)
        random_rows = x if len(rows) == len(seqs) else x[rows]
        tempered = apply_min_p(random_rows / temps[:, None], torch.tensor([p.min_p for p in params], device=dev))
        filtered = _filtered_logits(tempered, torch.tensor([p.top_k for p in params], device=dev),
                                    torch.tensor([p.top_p for p in params], device=dev))
        _draw(filtered.softmax(dim=-1), [seqs[j] for j in rows], tokens, rows)
        if want:
            logprobs[rows] = filtered.log_softmax(dim=-1)
    return tokens.tolist(), logprobs


def _draw(probs: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor, rows: list[int]) -> None:
    """tokens[rows[j]] = a draw from probs[j], with seqs[j]'s generator."""
    cdf = probs.cumsum(dim=-1)                                       # [R, V]
    for j, i in enumerate(rows):
        tokens[i] = draw(cdf[j], seqs[j])


def draw(cdf: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """A token from the distribution whose cumulative sums are `cdf` [V], with `seq`'s
    generator: inverse CDF, one uniform draw per token, the first token whose cumulative
    mass exceeds u * total (never a zero-probability one). An exponential race over the
    vocabulary cost ~2.5 ms a row (a scalar log per token). Speculative verification
    (spec_decode.py) draws each token the same way, so a seed gives the same tokens."""
    u = torch.rand((), generator=_generator(seq, cdf.device), device=cdf.device) * cdf[-1]
    return torch.searchsorted(cdf, u[None], right=True).clamp_(max=cdf.shape[0] - 1)[0]


def _filtered_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The logits with the tokens cut by each row's top-k and top-p at -inf. [R, V]

    Without any cut (top_k 0, top_p 1: the default) they are returned as they are; sorting the
    vocabulary for nothing was ~10 ms of a 40 ms SmolLM2 decode step. With top-k only the
    largest k are ranked (topk), and the whole vocabulary only when some row has top-p alone."""
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    if bool((k == vocab).all()) and bool((top_p >= 1.0).all()):
        return logits
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
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _generator(seq: Sequence, device: torch.device) -> torch.Generator:
    if seq.generator is None:
        seed = seq.params.seed if seq.params.seed is not None else random.getrandbits(63)
        seq.generator = torch.Generator(device=device).manual_seed(seed)
    return seq.generator


def _filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Softmax over the tokens that survive each row's top-k and top-p cuts. [R, V]"""
    return _filtered_logits(logits, top_k, top_p).softmax(dim=-1)
