"""The adaptive token budget (no torch, synthetic step times): it learns the step cost,
grows when few streams decode, shrinks as more do, and stays within its bounds."""

from __future__ import annotations

import random

import pytest

from engine.budget import AdaptiveBudget, FixedBudget, make_budget
from engine.config import EngineConfig


def cost(d: int, p: int) -> float:
    """A made-up CPU: 50 ms per step, 5 ms per decode row, 2 ms per prompt token."""
    return 0.050 + 0.005 * d + 0.002 * p


def trained(target_s=1.5, fixed=512, ceiling=4096, steps=40, noise=0.0) -> AdaptiveBudget:
    rng = random.Random(0)
    b = AdaptiveBudget(fixed, target_s, ceiling)
    for _ in range(steps):
        d, p = rng.randrange(0, 33), rng.choice([0, 0, rng.randrange(1, 800)])
        b.observe(d, p, cost(d, p) * (1 + rng.uniform(-noise, noise)))
    return b


def test_fit_recovers_the_step_cost():
    """From 40 steps of mixed decode / prefill work the fitted costs match the true ones."""
    a, b, c = trained().coef
    assert a == pytest.approx(0.050, rel=0.05) and b == pytest.approx(0.005, rel=0.05)
    assert c == pytest.approx(0.002, rel=0.05)


def test_fit_keeps_costs_non_negative_by_refitting_not_clamping():
    """Four start-up steps whose unconstrained fit has negative decode and prompt costs (a
    first prefill slowed by first touches; bench.engine.scheduling smoothness, Zen 4): the
    fit holds the negative costs at 0 and refits the rest, so a prompt token costs ~0.8 ms
    as measured (clamped: 0.09 ms, and the next step took 2,000 tokens, 1.9 s), and with
    16 decoding streams the budget stays near what two of their steps allow."""
    from engine.budget import _fit

    steps = [(0, 256, 0.306), (8, 248, 0.1549), (15, 8, 0.0403), (16, 0, 0.0192)]
    a, b, c = _fit(steps)
    assert min(a, b, c) >= 0.0 and 0.0005 <= c <= 0.0012 and a <= 0.05
    budget = AdaptiveBudget(16, 2.0, 8192)
    for d, p, t in steps:
        budget.observe(d, p, t)
    assert 16 <= budget.tokens(16) <= 64
    # on data an unconstrained fit explains, nothing is held: the same costs as before
    exact = [(d, p, cost(d, p)) for d, p in ((0, 100), (4, 0), (8, 30), (32, 0), (1, 500), (16, 16))]
    assert _fit(exact) == pytest.approx((0.050, 0.005, 0.002), rel=0.02)


def test_budget_grows_when_few_decode_and_shrinks_when_many_do():
    """Target 1.5 s, floor 16: with no decodes the step fills the target (725 tokens: 1.45 s
    / 2 ms, nobody's next token waits on it); while 32 streams decode a step may cost at
    most 2x their decode-only step (0.21 s): 32 + 105 tokens, and 4 decodes give 4 + 35."""
    b = trained(noise=0.05, fixed=16)
    few, many, some = b.tokens(0), b.tokens(32), b.tokens(4)
    assert 690 <= few <= 760 and 125 <= many <= 150 and 32 <= some <= 45
    assert cost(32, many - 32) <= 2 * cost(32, 0) * 1.05
    assert cost(4, some - 4) <= 2 * cost(4, 0) * 1.05


def test_bounds_fixed_floor_and_ceiling():
    """An unreachable target keeps the fixed budget (never starves prefill); a generous one
    stops at max_step_tokens."""
    assert trained(target_s=0.1).tokens(32) == 512
    assert trained(target_s=60.0).tokens(0) == 4096


def test_fixed_until_measured_and_outliers_ignored():
    """Before MIN_SAMPLES steps the budget is the fixed one; a step 10x slower than
    predicted (a compile, a stall) does not move the fit."""
    b = AdaptiveBudget(512, 1.5, 4096)
    assert b.tokens(0) == 512
    b = trained()
    before = b.tokens(8)
    b.observe(8, 300, 10 * cost(8, 300))
    assert b.tokens(8) == before


def test_decode_only_window_still_gives_a_cautious_budget():
    """Only decode steps seen (prompt cost unidentifiable): the prompt-token cost is taken
    as the mean per-token cost, which is pessimistic for prefill, so the budget stays at
    or below what the true cost would allow."""
    b = AdaptiveBudget(64, 1.5, 4096)
    for d in (4, 8, 16, 24, 32, 12, 6, 20):
        b.observe(d, 0, cost(d, 0))
    assert 64 <= b.tokens(8) <= 8 + (1.5 - cost(8, 0)) / 0.002


def test_make_budget_modes():
    """No target (the library default), prefill-first and static batching use the fixed budget."""
    assert type(make_budget(EngineConfig())) is FixedBudget
    assert type(make_budget(EngineConfig(itl_target_ms=1500, chunked_prefill=False))) is FixedBudget
    assert type(make_budget(EngineConfig(itl_target_ms=1500, batching="static"))) is FixedBudget
    assert type(make_budget(EngineConfig(itl_target_ms=1500))) is AdaptiveBudget
    with pytest.raises(ValueError, match="itl_target_ms"):
        EngineConfig(itl_target_ms=0)
    with pytest.raises(ValueError, match="max_step_tokens"):
        EngineConfig(max_step_tokens=100)


def test_engine_feeds_the_budget_and_it_grows_on_a_fast_model(tiny_model):
    """On the tiny model (steps of a few ms) a 1 s target lets the budget grow past the
    fixed 32 tokens, so a 300-token prompt is prefilled in fewer steps; outputs are the
    same tokens as with the fixed budget."""
    from engine import LLMEngine, SamplingParams

    results = {}
    for target in (None, 1000.0):
        eng = LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=32, max_num_seqs=8,
                                     itl_target_ms=target, num_kv_blocks=256))
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        for i in range(6):                                   # warm the fit with small requests
            eng.add_request(f"w{i}", [5 + i, 6, 7, 8] * (i + 1), params)
        while eng.has_unfinished():
            eng.step()
        eng.add_request("long", list(range(100, 400)), params)
        steps, toks = 0, []
        while eng.has_unfinished():
            toks += [t for o in eng.step() for t in o.new_token_ids]
            steps += 1
        results[target] = (steps, toks, eng.stats()["token_budget"])
    assert results[None][0] >= 10 and results[1000.0][0] <= 5
    assert results[1000.0][2] > 32 and results[None][2] == 32
    assert results[None][1] == results[1000.0][1]
