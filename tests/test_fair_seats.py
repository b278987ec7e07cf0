"""Fair seats on a tiny model: an arrival takes a seat from a flooding tenant by recompute or
by swap, and every output still equals HF greedy; the policy's bill is unchanged by it."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.models import TEST_POOL, assert_greedy_parity, load_reference

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seat_preemption_keeps_greedy_parity(tiny_model, mode):
    """Tenant a fills all 4 seats with long generations; three requests of tenant b arrive
    over time (b idle in between) and each gets its first token within a step, taking a
    seat from a by `mode`; every output equals HF greedy and each tenant is billed exactly
    its prompts and outputs, once, though a's sequences were recomputed or swapped."""
    rng = random.Random(11)
    eng = LLMEngine(EngineConfig(model=tiny_model("llama"), policy="fair", max_num_seqs=4, max_num_batched_tokens=64,
                                 preemption_mode=mode, num_swap_blocks=64 if mode == "swap" else 0,
                                 itl_target_ms=None, **TEST_POOL))
    prompts = {f"a{i}": [rng.randrange(100, 40_000) for _ in range(rng.randrange(10, 40))] for i in range(6)}
    prompts |= {f"b{i}": [rng.randrange(100, 40_000) for _ in range(rng.randrange(10, 40))] for i in range(3)}
    lengths = {rid: (40 if rid[0] == "a" else 8) for rid in prompts}
    arrivals = {0: ["a0", "a1", "a2", "a3", "a4", "a5"], 4: ["b0"], 16: ["b1"], 28: ["b2"]}
    outputs: dict[str, list[int]] = {}
    first_step: dict[str, int] = {}
    step = 0
    while step < 30 or eng.has_unfinished():
        for rid in arrivals.get(step, []):
            eng.add_request(rid, prompts[rid], SamplingParams(max_tokens=lengths[rid], **GREEDY), tenant=rid[0])
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_token_ids:
                first_step.setdefault(out.request_id, step)
        step += 1
    stats = eng.stats()
    assert stats["seat_preemptions"] >= 3
    assert stats["preemptions_swap" if mode == "swap" else "preemptions_recompute"] >= 3
    for rid, at in (("b0", 4), ("b1", 16), ("b2", 28)):
        assert first_step[rid] - at <= 1, (rid, first_step[rid])
    ref = load_reference(tiny_model("llama"))
    for rid, p in prompts.items():
        assert len(outputs[rid]) == lengths[rid]
        assert_greedy_parity(ref, p, outputs[rid], 1e-4)
    for tenant in "ab":
        mine = [rid for rid in prompts if rid[0] == tenant]
        assert stats["tenant_served_tokens"][tenant] == (sum(len(prompts[r]) for r in mine),
                                                          sum(lengths[r] for r in mine))
    assert stats["kv_blocks_used"] == 0 and stats["host_blocks_used"] == 0
