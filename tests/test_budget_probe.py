"""`max_num_batched_tokens=None` ("auto"): the budget measured at start (engine/budget_probe.py).

The choice is driven fast through a fake engine whose step costs are known; then a real
engine on a tiny model measures its own ladder, leaves no trace of the probe, and serves
HF's greedy tokens with the budget it chose."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.budget_probe import (FIT_RUNG, LADDER, MAX_CHOSEN_STEP_S, MAX_STEP_S, PIECE, TOLERANCE, choose, fit, ladder,
                                 measure, pieces)
from tests.models import hf_greedy, load_reference


def test_fit_recovers_a_known_curve_and_choose_takes_its_knee():
    """Per token 1 + 10 / size (units, not seconds: no step limit): a = 10, b = 1; within 2 % of
    b from 500 tokens, so 512; within 5 % from 200, so 256; the floor is respected."""
    curve = {m: 1.0 + 10.0 / m for m in (32, *LADDER)}
    free = float("inf")
    assert fit(curve) == (pytest.approx(10.0), pytest.approx(1.0))
    assert choose(curve, 0.02, max_step_s=free) == 512 and choose(curve, 0.05, max_step_s=free) == 256
    assert choose(curve, 0.05, floor=1024, max_step_s=free) == 1024
    assert choose({64: 1.0, 128: 1.0, 256: 1.0}, max_step_s=free) == 64               # no fixed cost: the smallest
    assert choose({64: 1.0, 128: 1.5, 256: 2.0}, floor=128, max_step_s=free) == 128   # cost rising with the size


def test_the_budget_step_takes_at_most_the_chosen_limit():
    """A large fixed cost puts the fit's knee past every size (60 ms a step, 0.9 ms a token:
    within 2 % of b only from ~3,300 tokens, so 2,048), but a 2,048-token step takes 1.9 s and
    a 1,024-token one 0.98 s: the budget is the largest size within MAX_CHOSEN_STEP_S, 1,024;
    where no size is, the smallest; a curve whose knee comes first keeps its knee."""
    curve = {m: 0.0009 + 0.060 / m for m in (32, *LADDER)}
    assert MAX_CHOSEN_STEP_S == 1.0
    assert choose(curve, max_step_s=float("inf")) == 2048
    assert choose(curve) == 1024 and choose(curve, max_step_s=0.3) == 256
    assert choose(curve, floor=64, max_step_s=0.01) == 64
    assert choose({m: 0.001 + 0.010 / m for m in LADDER}) == 512


def test_a_noisy_flat_curve_does_not_choose_by_its_luckiest_size():
    """Five probes' medians on Zen 4 (µs a token, 2026-12-07, max_num_seqs 64): the curve is flat
    past ~128 within the rounds' noise; the smallest size within 2 % of the cheapest one took
    128, 512 and 1,024 among them, the fit takes 512 in every one."""
    probes = [{32: 757, 64: 795, 128: 633, 256: 629, 512: 609, 1024: 613, 2048: 628},
              {32: 717, 64: 751, 128: 593, 256: 636, 512: 667, 1024: 623, 2048: 628},
              {32: 753, 64: 666, 128: 654, 256: 620, 512: 638, 1024: 595, 2048: 597},
              {32: 746, 64: 660, 128: 621, 256: 611, 512: 595, 1024: 592, 2048: 598},
              {32: 746, 64: 663, 128: 629, 256: 601, 512: 591, 1024: 584, 2048: 584}]
    best_size = [min(m for m, s in p.items() if m >= 64 and s <= 1.02 * min(p.values())) for p in probes]
    assert set(best_size) == {128, 512, 1024}
    seconds = [{m: us * 1e-6 for m, us in p.items()} for p in probes]     # 2,048 tokens: 1.2-1.3 s a step
    assert [choose(p, floor=64) for p in seconds] == [512] * 5


def test_ladder_starts_at_the_floor_and_stops_at_the_ceiling():
    assert ladder(64, 4096) == list(LADDER)
    assert ladder(100, 600) == [100, 128, 256, 512]
    assert ladder(64, 300) == [64, 128, 256]
    assert ladder(8, 40) == [8]


@pytest.mark.parametrize("size, max_seqs", [(64, 64), (100, 64), (2048, 64), (2048, 8), (16, 4), (1000, 3)])
def test_pieces_carry_every_token_in_at_most_max_seqs_prompts(size, max_seqs):
    got = pieces(size, max_seqs)
    assert sum(got) == size and 1 <= len(got) <= max_seqs
    assert min(got) >= min(size, PIECE) and max(got) - min(got) <= 1


class FakeEngine:
    """Steps cost `overhead + per_token x tokens` seconds: per token, overhead / m + per_token,
    which falls with the size m (as a step's fixed costs spread) towards per_token."""

    vocab_size = 1000

    def __init__(self, overhead: float, per_token: float, max_num_seqs: int = 64):
        self.overhead, self.per_token = overhead, per_token
        self.config = EngineConfig(max_num_seqs=max_num_seqs)
        self.queued: list[int] = []
        self.steps: list[int] = []          # tokens of each step run
        self.step_time_s = 0.0

    def add_request(self, request_id, prompt, params) -> None:
        assert params.max_tokens == 1 and request_id.startswith("budget-probe-")
        self.queued.append(len(prompt))

    def has_unfinished(self) -> bool:
        return bool(self.queued)

    def step(self) -> None:
        tokens, self.queued = sum(self.queued), []
        self.steps.append(tokens)
        self.step_time_s = self.overhead + self.per_token * tokens


def test_measure_finds_the_knee_of_a_known_cost_curve():
    """10 ms a step, 1 ms a token: per token 1 + 10/m ms, fitted exactly (b = 1 ms); within 2 %
    of b (1.02 ms) the smallest size is 512 (1.0195 ms; 256 costs 1.039). The 32-token rung is
    timed below the floor of 64 for the fit, and not chosen."""
    eng = FakeEngine(0.010, 0.001)
    probe = measure(eng, 64, 2048)
    assert probe.tokens == 512 and TOLERANCE == 0.02
    assert probe.per_token_s == pytest.approx({m: 0.001 + 0.010 / m for m in (FIT_RUNG, *LADDER)})
    assert sorted(set(eng.steps)) == [FIT_RUNG, *LADDER]   # each size as one step of its tokens (32: the fit's)


class LuckyFakeEngine(FakeEngine):
    """FakeEngine whose second timed step of `lucky` tokens runs 10 % fast (a shared host's
    quiet moment)."""

    def __init__(self, lucky: int, *args):
        super().__init__(*args)
        self.lucky = lucky

    def step(self) -> None:
        super().step()
        if self.steps[-1] == self.lucky and self.steps.count(self.lucky) == 3:    # the warm round is the first
            self.step_time_s *= 0.9


def test_one_lucky_round_does_not_choose_the_budget():
    """Each size's time is the median of its rounds: a 2,048-token step that once ran 10 %
    fast (its best round 0.904 ms a token, below every other size's) leaves the choice where
    the steady curve puts it, 512."""
    eng = LuckyFakeEngine(2048, 0.010, 0.001)
    probe = measure(eng, 64, 2048)
    assert eng.steps.count(2048) == 4
    assert probe.tokens == 512
    assert probe.per_token_s[2048] == pytest.approx(0.001 + 0.010 / 2048)


def test_a_size_slower_than_the_limit_ends_the_ladder():
    """At 3 ms a token a 1,024-token step takes 3.07 s > MAX_STEP_S: it is the last size timed
    after the warm round (all 3 rounds), and 2,048 (6.1 s, under the warm round's 4x limit)
    is not timed again."""
    eng = FakeEngine(0.010, 0.003)
    assert 0.010 + 0.003 * 512 < MAX_STEP_S < 0.010 + 0.003 * 1024
    probe = measure(eng, 64, 2048)
    assert sorted(probe.per_token_s) == [FIT_RUNG, 64, 128, 256, 512, 1024]
    assert eng.steps.count(2048) == 1 and eng.steps.count(1024) == 4


def test_auto_budget_needs_chunked_continuous_batching():
    for kw in (dict(chunked_prefill=False), dict(batching="static")):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            EngineConfig(max_num_batched_tokens=None, **kw)
    assert EngineConfig(max_num_batched_tokens=None).max_num_batched_tokens is None


@pytest.mark.parametrize("mode", [{}, dict(tensor_parallel_size=2), dict(num_speculative_tokens=3), dict(compile=True)],
                         ids=["eager", "tp2", "speculative", "compiled"])
def test_engine_measures_its_budget_and_serves_hf_greedy_with_it(tiny_model, mode):
    """A real engine on a tiny model, in each way an engine steps: the budget is one the
    probe's own timings choose, the config and limits carry it, the probe's requests leave
    no trace (no finished requests, every block free, no cached prefix), and the tokens are
    HF's."""
    model = tiny_model("llama")
    eng = LLMEngine(EngineConfig(model=model, max_num_batched_tokens=None, max_num_seqs=16, max_model_len=600,
                                 num_kv_blocks=160, **mode))
    try:
        _check_probe_and_parity(eng, model)
    finally:
        eng.close()


def _check_probe_and_parity(eng, model) -> None:
    probe = eng.budget_probe
    assert probe is not None and sorted(probe.per_token_s) == ladder(16, 599)
    assert eng.config.max_num_batched_tokens == probe.tokens == choose(probe.per_token_s)
    assert eng.limits.max_num_batched_tokens == probe.tokens == eng.scheduler.budget.tokens(0)
    stats = eng.stats()
    assert stats["num_steps"] == stats["prompt_tokens"] == stats["generation_tokens"] == 0
    assert stats["waiting"] == stats["running"] == stats["kv_blocks_used"] == stats["prefix_cache_query_tokens"] == 0
    prompts = [[(7 * i + j) % 500 + 3 for j in range(40 + 90 * i)] for i in range(4)]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    ref = load_reference(model)
    assert [got[f"r{i}"] for i in range(4)] == [hf_greedy(ref, p, 6) for p in prompts]


async def test_a_served_auto_budget_reaches_the_stats_stream(tiny_model, tmp_path):
    """`--max-num-batched-tokens auto` served on a real uvicorn: the WebSocket stats stream
    states the budget the engine measured (not the configured None), and a chat streams to
    its one chat.done."""
    import json

    import websockets

    from tests.live import KEYS, serve

    with serve(tiny_model("llama"), tmp_path, engine_kw={"max_num_batched_tokens": None}) as live:
        measured = live.gateway.engine.limits.max_num_batched_tokens
        assert isinstance(measured, int) and measured >= 8
        async with websockets.connect(live.ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": KEYS["acme"]}))
            assert json.loads(await ws.recv())["type"] == "auth.ok"
            await ws.send(json.dumps({"type": "stats.subscribe", "interval_ms": 100}))
            await ws.send(json.dumps({"type": "chat.request", "id": "a", "max_tokens": 8,
                                      "messages": [{"role": "user", "content": "hi"}]}))
            kinds, budgets = [], set()
            while "chat.done" not in kinds:
                msg = json.loads(await asyncio.wait_for(ws.recv(), timeout=30))
                kinds.append(msg["type"])
                if msg["type"] == "stats":
                    budgets.add(msg["max_num_batched_tokens"])
            assert kinds.count("chat.done") == 1 and "error" not in kinds
            while not budgets:
                msg = json.loads(await asyncio.wait_for(ws.recv(), timeout=30))
                if msg["type"] == "stats":
                    budgets.add(msg["max_num_batched_tokens"])
            assert budgets == {measured}
