"""engine/ngram_history.py: proposals from a tenant's finished requests — the longest, newest
match; never another tenant's; bounded, evicted n-grams gone with their sequence; and in the
engine, a repeated request drafts its whole answer from the first one's, with the tokens of a
run without speculation."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.ngram_history import NgramHistory


def test_the_longest_newest_match_proposes_what_followed_it():
    h = NgramHistory(1000, lo=2, hi=4)
    h.add("a", [1, 2, 3, 4, 5, 6, 7])
    h.add("a", [9, 2, 3, 8, 8])
    assert h.propose("a", [0, 0, 2, 3], 3) == [8, 8]           # (2, 3): the newer sequence's
    assert h.propose("a", [0, 1, 2, 3], 3) == [4, 5, 6]        # (1, 2, 3) is longer: the older one's
    assert h.propose("a", [5, 6], 5) == [7]                    # up to the sequence's end
    assert h.propose("a", [6, 7], 3) == [] and h.propose("a", [4], 3) == []   # nothing after / below lo
    assert h.propose("a", [0, 1, 2, 3], 3, longer_than=3) == []


def test_a_tenant_never_gets_another_tenants_tokens():
    h = NgramHistory(1000, lo=2, hi=4)
    h.add("a", [1, 2, 3, 4])
    h.add(None, [1, 2, 5, 6])
    assert h.propose("a", [1, 2], 2) == [3, 4]
    assert h.propose("b", [1, 2], 2) == []
    assert h.propose(None, [1, 2], 2) == [5, 6] and h.propose("", [1, 2], 2) == [5, 6]


def test_the_history_is_bounded_and_evicted_ngrams_leave_with_their_sequence():
    h = NgramHistory(20, lo=2, hi=3)
    h.add("a", [1, 2, 3, 4, 5, 6, 7, 8])                       # 8 tokens
    h.add("a", [10, 11, 12, 13, 14, 15, 16, 17])                # 16
    h.add("a", [20, 21, 22, 23, 2, 3, 9, 9])                    # 24 > 20: the first goes
    assert h.size("a")[0] == 16
    assert h.propose("a", [4, 5], 2) == []                      # only the evicted sequence had it
    assert h.propose("a", [2, 3], 2) == [9, 9]                  # held by the newest
    # Every n-gram indexed is one of the kept sequences' (none of the evicted one's is left).
    kept = [[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 2, 3, 9, 9]]
    grams = {tuple(s[i - n + 1:i + 1]) for s in kept for i in range(len(s) - 1) for n in (2, 3) if i + 1 >= n}
    assert set(h.tenants["a"].index) == grams and h.size("a")[1] == len(grams)
    h.add("a", list(range(100, 150)))                           # longer than the whole history
    assert h.size("a")[0] == 20 and h.propose("a", [140, 141], 3) == [142, 143, 144]


def test_the_field_is_validated_and_reaches_the_cli():
    import argparse

    from engine.config_cli import add_engine_args, engine_config_from_args

    with pytest.raises(ValueError, match="EngineConfig.speculative_history_tokens"):
        EngineConfig(speculative_history_tokens=-1)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).speculative_history_tokens == 0
    args = p.parse_args(["--speculative-history-tokens", "65536"])
    assert engine_config_from_args(args).speculative_history_tokens == 65536


def _serve(eng: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, tenant: str) -> tuple[list[int], int]:
    """One request to the end: its tokens and the drafts accepted meanwhile."""
    before = eng.stats()["spec_accepted_tokens"]
    eng.add_request(rid, prompt, params, tenant=tenant)
    tokens: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens.extend(out.new_token_ids)
    return tokens, eng.stats()["spec_accepted_tokens"] - before


def test_a_repeated_request_drafts_the_first_answer_and_keeps_its_tokens(tiny_model):
    """With the history on, the second of two identical greedy requests of one tenant has its
    answer drafted from the first's: nearly every token accepted, where its own tokens alone
    give far fewer; another tenant's identical request gets what the history-off engine gives.
    The tokens are the plain run's throughout."""
    model = tiny_model("llama")
    prompt = list(range(300, 360))                          # no repeats: its own n-grams propose little
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=model, num_kv_blocks=256))
    want, _ = _serve(plain, "p", prompt, params, "a")
    runs = {}
    for history in (0, 4096):
        eng = LLMEngine(EngineConfig(model=model, num_kv_blocks=256, num_speculative_tokens=4,
                                     speculative_history_tokens=history))
        runs[history] = [_serve(eng, rid, prompt, params, tenant)
                         for rid, tenant in (("first", "a"), ("again", "a"), ("other", "b"))]
    for history, served in runs.items():
        assert [tokens for tokens, _ in served] == [want] * 3, history
    (_, off_first), (_, off_again), (_, off_other) = runs[0]
    (_, on_first), (_, on_again), (_, on_other) = runs[4096]
    assert on_first == off_first and on_other == off_other == off_again    # nothing to draw on / not its tenant's
    # 47 tokens after the prompt's, at most 4 of every 5 of them accepted drafts: at most 37.
    assert on_again >= 36 and off_again <= 20, (on_again, off_again)
