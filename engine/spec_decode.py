"""A step whose batch verifies speculative proposals (speculative.py), and the acceptance rule.

An entry with drafts d1..dk computed [last token, d1..dk]; the runner returns the logits at
those k+1 positions. Row j's token t_j is drawn exactly as a plain decode row draws it
(greedy: argmax; otherwise inverse CDF of the row's distribution p_j with one uniform from
the sequence's generator: sampler.draw_rows, or sampler.draw where a top-k or top-p cut
applies); a grammar-constrained row's from its logits masked by the grammar's state after
d1..dj (GrammarRuntime.draft_masks), as sample_step draws a constrained row. The run keeps
t_0, t_1, ... while each equals the draft it was computed after (t_j == d_{j+1}) and ends
with the first that does not (the correction) or with t_k (the bonus token): 1 to k+1 tokens.

Why this is exact: every kept token was drawn from the model's distribution given the
tokens before it, which are the committed history plus accepted drafts, i.e. the tokens
the sequence really has, so greedy output is the non-speculative output and a seeded
request draws the same uniforms for the same positions and gets the same tokens. As a
rejection sampler for a point-mass draft x: t = x happens with probability p(x) (accept),
and given t != x, t is distributed as p with x removed and renormalized (the residual) -
the standard rule for a draft distribution q = delta_x, with its coupling fixed by the
uniform (tests/test_speculative.py checks both against torch).

Committing a run goes token by token through what a decode step does (catch up one
position and commit full blocks, append and charge the token, stop tokens and lengths,
stop strings, all in Scheduler.append_token, then LLMEngine._emit), so a run ends exactly
where the plain run would.
The KV of rejected drafts is rolled back: the sequence's computed length covers only kept
positions, and blocks past its tokens go back to the pool (BlockManager.rollback).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .prompt_logprobs import record as record_prompt_logprobs
from .prompt_logprobs import rows as prompt_logprob_rows
from .sampler import draw, draw_constrained, draw_rows, drawn_in_kernel, plain_probs, sample_step
from .sampler import greedy as greedy_tokens
from .sequence import RequestOutput, Sequence

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .scheduler_output import SchedulerOutput


def verify(logits: torch.Tensor, drafted: list[tuple[Sequence, list[int]]],
           banned: dict[int, torch.Tensor] | None = None) -> list[list[int]]:
    """`logits` [R, V]: 1 + len(drafts) rows per drafted sequence, in order. Returns each
    sequence's run: the accepted drafts and one token of the model's own. `banned`: row ->
    bool [V], the tokens a constrained row's grammar bans at that position (after the drafts
    before it: GrammarRuntime.draft_masks); those rows are drawn from a masked copy as
    sample_step draws a constrained row (sampler.draw_constrained)."""
    banned = banned or {}
    greedy = greedy_tokens(logits).tolist()
    starts, rows, sampled = [], [], []
    for seq, drafts in drafted:
        starts.append(len(rows))
        rows.extend([seq] * (len(drafts) + 1))
        sampled.append(not seq.params.greedy)
    constrained = {r for r, seq in enumerate(rows) if seq.grammar_state is not None}
    cdf, at = None, {}
    if any(sampled):                  # rows drawn with torch's cumulative sums (a top-k or top-p cut)
        keep = [r for r, seq in enumerate(rows) if not seq.params.greedy and r not in constrained
                and not drawn_in_kernel(logits, seq.params)]
        at = {r: j for j, r in enumerate(keep)}
        cdf = plain_probs(logits[keep], [rows[r] for r in keep]).cumsum(dim=-1) if keep else None   # [R', V]

    def drawn(r: int, seq: Sequence) -> int:      # as a plain decode row draws it (sampler._plain)
        if r in constrained:
            row = logits[r] if r not in banned else logits[r].masked_fill(banned[r], float("-inf"))
            return draw_constrained(row, seq)
        if r in at:
            return int(draw(cdf[at[r]], seq))
        return int(draw_rows(logits[r:r + 1], [seq])[0])

    runs = []
    for (seq, drafts), start, is_drawn in zip(drafted, starts, sampled):
        run: list[int] = []
        for j in range(len(drafts) + 1):
            r = start + j
            run.append(drawn(r, seq) if is_drawn or r in constrained else greedy[r])
            if j == len(drafts) or run[-1] != drafts[j]:
                break
        runs.append(run)
    return runs


def step(engine: LLMEngine, batch: SchedulerOutput) -> list[RequestOutput]:
    """LLMEngine.step's forward, sampling and update for a batch with drafts: plain rows as
    in a plain step, then each drafted sequence's run."""
    sched, plain = engine.scheduler, batch.sampling_seqs
    masks = engine.grammars.masks(plain)
    draft_masks = engine.grammars.draft_masks(batch.drafted)  # each verified position's
    plan = prompt_logprob_rows(batch)
    logits = engine.runner.run(batch)
    end = len(plain) + sum(1 + len(drafts) for _, drafts in batch.drafted)
    if plan:                                                  # prompt positions' rows come last
        record_prompt_logprobs(batch, plan, logits[end:])
    tokens, logprobs = sample_step(logits[:len(plain)], plain, masks and masks.result(logits.device))
    engine.grammars.advance(plain, tokens)
    runs = verify(logits[len(plain):end], batch.drafted, draft_masks and draft_masks.result(logits.device))
    now = engine.clock()
    outputs = []
    for j, seq in enumerate(sched.update(batch, tokens)):
        outputs.append(engine._emit(seq, now))
        if logprobs is not None and logprobs[j] is not None and outputs[-1].new_token_ids:
            outputs[-1].logprobs = [logprobs[j]]           # (none for max_tokens 0: no token)
    for (seq, drafts), run in zip(batch.drafted, runs):
        sched.speculator.record(seq, len(drafts), len(run) - 1)
        out = None
        for token in run:
            seq.num_computed_tokens += 1                      # the position before `token`
            sched.bm.commit(seq)
            if seq.grammar_state is not None:
                seq.grammar_state.consume(token)              # before append_token checks `complete`
            sched.append_token(seq, token)
            one = engine._emit(seq, now)
            out = one if out is None else out.merge(one)
            if seq.status.finished:
                break
        if not seq.status.finished:
            sched.bm.rollback(seq)
        outputs.append(out)
    return outputs
