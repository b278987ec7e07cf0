"""Shared by the speculative-decoding tests: input-grounded prompts, staggered arrivals, an
engine with n-gram speculation, and a run to the end that checks the block manager's
invariants after every step."""

from __future__ import annotations

import random

from engine import EngineConfig, LLMEngine, SamplingParams


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Input-grounded prompts: a random text, then the text again up to a cut."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = [rng.randrange(100, 40_000) for _ in range(rng.randrange(10, 90))]
        out.append(text + text[:rng.randrange(1, len(text))])
    return out


def staggered(ps: list[list[int]], params: SamplingParams) -> dict[int, list[tuple]]:
    return {i * 3: [(f"r{i}", p, params)] for i, p in enumerate(ps)}


def engine(model: str, k: int, **cfg) -> LLMEngine:
    cfg.setdefault("num_kv_blocks", 512)
    return LLMEngine(EngineConfig(model=model, num_speculative_tokens=k, speculative_ngram_min=1, **cfg))


def run(eng: LLMEngine, arrivals) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Steps to the end, checking the block manager's invariants after every step; returns
    tokens and finish reasons."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while eng.has_unfinished() or any(s >= step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt, params)
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        sched = eng.scheduler
        eng.block_manager.check_invariants(sched.running + sched.swapped)
        step += 1
        assert step < 5000
    assert eng.stats()["kv_blocks_used"] == 0
    return tokens, reasons


def run_to_completion_logprobs(eng: LLMEngine, reqs, lps: list) -> dict[str, list[int]]:
    for rid, p, params in reqs:
        eng.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == "lp" and out.logprobs:
                lps.extend(out.logprobs)
    return tokens
