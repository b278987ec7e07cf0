"""Speculative decoding with tensor parallelism (2 gloo ranks). A file of its own: a process
holds one tensor-parallel engine at a time (torch.distributed's default group), and
tests/test_tp.py's module-scoped engines stay open until that module ends, so a test there
that builds its own engine depends on the order pytest gives the parametrized fixture."""

from __future__ import annotations

import random

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.models import run_to_completion
from tests.test_tp import PRESSURE


def test_speculative_decoding_on_two_ranks_equals_one_process_without_it(repeat_model):
    """2 ranks verifying n-gram drafts, under chunked prefill and recompute and swap
    preemption: the drafts travel in the prepared step rank 0 broadcasts, every rank writes
    their KV to its own pool and rewrites the rejected ones' slots later, as one process
    does, so fp32 greedy output equals the one-process engine without speculation, with
    drafts accepted; grammar-constrained rows among them draft too (rank 0's matchers)."""
    from engine import Grammar
    model = repeat_model
    rng = random.Random(5)
    arrivals: dict[int, list[tuple]] = {}
    for i in range(6):                        # input-grounded: a text, then the text again up to a cut
        text = [rng.randrange(100, 40_000) for _ in range(rng.randrange(10, 70))]
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        arrivals[i] = [(f"s{i}", text + text[:rng.randrange(1, len(text))], params)]
    for i in range(2):                        # structured output: records under a regex
        params = SamplingParams(max_tokens=48, temperature=0.0,
                                grammar=Grammar("regex", r'(\{"id": [0-9]{1,2}, "ok": (true|false)\}, ){2,6}\{"id": 0\}'))
        arrivals[6 + i] = [(f"g{i}", [rng.randrange(100, 40_000) for _ in range(20)], params)]
    want = run_to_completion(LLMEngine(EngineConfig(model=model, **PRESSURE)), arrivals)
    tp = LLMEngine(EngineConfig(model=model, tensor_parallel_size=2, tp_timeout_s=60.0, num_speculative_tokens=3,
                                speculative_ngram_min=1, **PRESSURE))
    try:
        got = run_to_completion(tp, arrivals)
        stats = tp.stats()
    finally:
        tp.close()
    assert got == want
    assert stats["spec_accepted_tokens"] > 0 and stats["preemptions_recompute"] + stats["preemptions_swap"] > 0
