"""Speculative decoding for grammar-constrained rows (engine/grammar_runtime.py's drafts and
masks, spec_decode.verify's banned tokens): drafts cut where the grammar refuses, EOS drafts
rolled back, and constrained rows that keep their unspeculated output."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.speculative_util import engine, prompts, run


RECORDS = r'\[(\{"name": "[a-z]{1,6}", "id": [0-9]{1,3}\}, ){2,5}\{"name": "[a-z]{1,6}", "id": [0-9]{1,3}\}\]'


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_rows_speculate_and_keep_their_output(repeat_model, temperature):
    """Grammar-constrained rows alone in the batch (greedy, and seeded sampling at temperature
    1) draft what their grammar forces or their n-grams propose, cut where the grammar refuses;
    verified under the grammar's mask at each position, they accept drafts and end with the
    tokens, text and finish reasons they get without speculation, text the grammar matches."""
    import re

    from engine import Grammar

    ps = prompts(3, seed=21)
    reqs = [(f"g{i}", p, SamplingParams(max_tokens=120, temperature=temperature, seed=50 + i,
                                         grammar=Grammar("regex", RECORDS))) for i, p in enumerate(ps)]
    seen = []
    for k in (0, 4):
        eng = engine(repeat_model, k)
        tokens, reasons = run(eng, {0: reqs[:2], 3: reqs[2:]})
        texts = {rid: eng.tokenizer.decode(t) for rid, t in tokens.items()}
        seen.append((tokens, reasons))
        if k:
            stats = eng.stats()
            assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
            for rid, text in texts.items():
                assert reasons[rid] == "stop" and re.fullmatch(RECORDS, text), (rid, text)
    assert seen[0] == seen[1]


def test_grammar_drafts_are_cut_where_the_grammar_refuses(repeat_model):
    """GrammarState.drafts: the forced continuation first, else the n-gram proposal cut at
    the first token the grammar refuses; a matcher is left where it was."""
    from engine import Grammar

    eng = engine(repeat_model, 4)
    tok = eng.tokenizer
    eng.add_request("g", prompts(1)[0], SamplingParams(max_tokens=20, temperature=0.0,
                                                       grammar=Grammar("regex", "abc[0-9]+;")))
    seq = eng.scheduler.waiting[0] if eng.scheduler.waiting else eng.scheduler.running[0]
    state = seq.grammar_state
    state.future.result(timeout=30)
    assert state.ready
    forced = state.drafts([], lambda: [], 4)
    assert tok.decode(forced) == "abc"[:len(tok.decode(forced))] and forced       # the literal, forced
    digits = tok("12;", add_special_tokens=False)["input_ids"]
    out_ids = tok("abc", add_special_tokens=False)["input_ids"]
    bad = tok("x", add_special_tokens=False)["input_ids"]
    assert state.drafts(out_ids, lambda: digits + bad + digits, 8) == digits    # cut at "x"
    assert state.consumed == len(out_ids) and state.matcher.validate_tokens(digits) == len(digits)
    eng.abort("g")


def test_an_eos_draft_where_the_grammar_accepts_is_kept_and_rolled_back(repeat_model):
    """Where the grammar accepts, an n-gram proposal may hold EOS (a chat template's end
    token is in the prompt): it is the last draft kept, its verified position is masked
    after it, and the matcher is where it was once the masks are made."""
    from engine import Grammar

    eng = engine(repeat_model, 4)
    tok = eng.tokenizer
    eng.add_request("g", prompts(1)[0], SamplingParams(max_tokens=20, temperature=0.0,
                                                       grammar=Grammar("regex", "ab[0-9]+")))
    seq = eng.scheduler.waiting[0]
    state = seq.grammar_state
    state.future.result(timeout=30)
    assert state.ready
    out_ids = tok("ab12", add_special_tokens=False)["input_ids"]
    seq.output_token_ids = list(out_ids)
    eos = tok.eos_token_id
    three = tok("3", add_special_tokens=False)["input_ids"]
    drafts = state.drafts(seq.output_token_ids, lambda: [eos] + three, 4)
    assert drafts == [eos]                                           # nothing after EOS
    banned = eng.grammars.draft_masks([(seq, drafts)]).result()
    assert not banned[0][three[0]] and not banned[0][eos]            # before it: digits or the end
    assert banned[1].sum() == banned[1].numel() - 1 and not banned[1][eos]   # after it: only EOS
    assert not state.matcher.is_stopped() and state.matcher.validate_tokens(three) == 1
    eng.abort("g")
