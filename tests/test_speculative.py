"""Speculative decoding without a draft model (engine/speculative.py, engine/spec_decode.py):
n-gram proposals, the acceptance rule against torch's distribution, and the engine's
output with speculation equal to HF generate and to the engine without it, under staggered
arrivals, chunked prefill, prefix caching, preemption (recompute and swap), stop tokens,
stop strings and lengths inside accepted runs, and seeded sampling.

The model is a tiny random Llama with tied embeddings and initializer_range 0.1: its greedy
output falls into runs of one repeated token broken by context-dependent changes, so
proposals are both accepted and rejected (each test asserts acceptances > 0)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import SamplingParams as SP
from engine.sequence import Sequence
from engine.spec_decode import verify
from engine.speculative import NgramIndex, Speculator, plain_sampling
from tests.models import assert_greedy_parity, load_reference, run_to_completion

FP32_TOL = 1e-4


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


# -- proposals --------------------------------------------------------------------------
def test_ngram_index_proposes_what_followed_the_longest_matching_suffix():
    """The longest suffix n-gram that occurred before wins, its most recent occurrence is
    used, a continuation reaching the present repeats it, and no match proposes nothing."""
    idx = NgramIndex(1, 3)
    assert idx.propose([5, 1, 2, 3, 7, 8, 9, 2, 3, 6, 1, 2, 3], 3) == [7, 8, 9]    # (1,2,3), not (2,3)->6
    assert NgramIndex(1, 3).propose([5, 2, 3, 6, 2, 3, 4, 2, 3], 2) == [4, 2]     # most recent (2,3)
    assert NgramIndex(2, 4).propose([4, 4, 4], 5) == [4, 4, 4, 4, 4]              # a loop of period 1
    assert NgramIndex(2, 4).propose([1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]           # period 3
    assert NgramIndex(2, 4).propose([1, 2, 3, 4], 4) == []
    grown = NgramIndex(1, 2)                       # incremental: the index follows appended tokens
    tokens = [9, 8]
    assert grown.propose(tokens, 2) == []
    tokens += [7, 9]
    assert grown.propose(tokens, 2) == [8, 7]


def test_sequences_whose_proposals_fail_stop_proposing_for_a_while():
    """Two verifications accepting nothing turn proposals off for a back-off that doubles."""
    spec = Speculator(EngineConfig(num_speculative_tokens=4, speculative_ngram_min=1))
    seq = Sequence("s", [3, 3, 3, 3], SP(max_tokens=100, temperature=0.0))
    seq.output_token_ids = [3]
    assert spec._propose(seq, 4) == [3, 3, 3, 3]
    spec.record(seq, 4, 0)
    assert spec._propose(seq, 4)                                   # one bad verification is not enough
    spec.record(seq, 4, 0)
    assert [spec._propose(seq, 4) for _ in range(4)] == [[]] * 4   # backed off 4 decode steps
    assert spec._propose(seq, 4)
    spec.record(seq, 4, 0)
    assert [bool(spec._propose(seq, 4)) for _ in range(9)] == [False] * 8 + [True]   # then 8
    assert spec.stats()["spec_acceptance_rate"] == 0.0


def test_only_plain_sampling_rows_propose():
    """Penalties, logit bias, min-p and logprobs leave speculation off for the row; a grammar
    does not (its rows draft what the grammar accepts, verified under its masks)."""
    from engine import Grammar

    assert plain_sampling(SP(temperature=0.7, top_k=5, top_p=0.9, seed=1))
    assert plain_sampling(SP(temperature=0.0, grammar=Grammar("regex", "[0-9]+")))
    for extra in (dict(logprobs=0), dict(min_p=0.1), dict(presence_penalty=0.5), dict(repetition_penalty=1.1),
                  dict(logit_bias=((5, 1.0),))):
        assert not plain_sampling(SP(**extra))


# -- the acceptance rule ----------------------------------------------------------------
def _rows(n: int, params: SP) -> list[Sequence]:
    return [Sequence(f"s{i}", [1], SP(**{**params.__dict__, "seed": i})) for i in range(n)]


@pytest.mark.parametrize("top_k", [0, 3])
def test_acceptance_is_rejection_sampling_against_torch(top_k):
    """Draft x after one row of logits: accepted with probability p(x); rejected, the token
    follows p with x removed and renormalized; accepted, the bonus token follows the next
    row's p. p is torch's softmax of logits / temperature (top-k cut), and frequencies over
    4,000 seeded rows are within 4.5 standard errors of it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, generator=g) * 1.5                     # [2 positions, V]
    temperature, n = 0.8, 4000
    p = torch.softmax(logits / temperature, dim=-1)
    if top_k:
        cut = p < p.topk(top_k, dim=-1).values[:, -1:]
        p = torch.softmax((logits / temperature).masked_fill(cut, float("-inf")), dim=-1)
    x = int(p[0].argsort()[-2])                                        # the second most likely token
    seqs = _rows(n, SP(temperature=temperature, top_k=top_k))
    runs = verify(logits.repeat(n, 1), [(s, [x]) for s in seqs])
    first = torch.tensor([r[0] for r in runs])
    accepted = first == x
    assert all(len(r) == (2 if r[0] == x else 1) for r in runs)

    def within(count: int, total: int, prob: float) -> None:
        se = (prob * (1 - prob) / total) ** 0.5
        assert abs(count / total - prob) <= 4.5 * se + 1e-9, (count, total, prob)

    within(int(accepted.sum()), n, float(p[0, x]))
    residual = p[0].clone()
    residual[x] = 0
    residual /= residual.sum()
    rejected = first[~accepted]
    bonus = torch.tensor([r[1] for r in runs if len(r) == 2])
    for v in range(6):
        within(int((rejected == v).sum()), len(rejected), float(residual[v]))
        within(int((bonus == v).sum()), len(bonus), float(p[1, v]))


def test_greedy_acceptance_keeps_the_matching_prefix_and_the_model_token():
    """Greedy: drafts are kept while they equal the argmax, then the argmax is appended."""
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([4, 5, 9, 2]):
        logits[row, best] = 1.0
    seqs = _rows(3, SP(temperature=0.0))
    assert verify(logits.repeat(3, 1), [(seqs[0], [4, 5, 6]), (seqs[1], [4, 5, 9]), (seqs[2], [7, 5, 9])]) == \
        [[4, 5, 9], [4, 5, 9, 2], [4]]


# -- the engine -------------------------------------------------------------------------
@pytest.mark.parametrize("path", [dict(attention_backend="kernel"), dict(attention_backend="torch"),
                                  dict(attention_backend="kernel", fused_layers=False)],
                         ids=["kernel", "torch", "kernel-hf-forward"])
def test_greedy_output_equals_hf_and_no_speculation_under_chunking_and_prefix_caching(repeat_model, path):
    """Eight input-grounded prompts arriving every 3 steps (two sharing a long prefix), a
    32-token budget chunking prompts beside decodes and drafts, prefix caching on, on each
    CPU attention path: every output equals HF generate and the engine without speculation,
    and drafts were accepted."""
    ps = prompts(8)
    ps[5] = ps[1][:40] + ps[5]                                         # prefix-cache hits
    ps[6] = ps[1][:48] + [7, 8, 9]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cfg = dict(max_num_batched_tokens=32, max_num_seqs=8, block_size=8, num_kv_blocks=200, **path)
    plain = engine(repeat_model, 0, **cfg)
    want, _ = run(plain, staggered(ps, params))
    eng = engine(repeat_model, 4, **cfg)
    got, _ = run(eng, staggered(ps, params))
    assert got == want
    ref = load_reference(repeat_model)
    for i, p in enumerate(ps):
        assert_greedy_parity(ref, p, got[f"r{i}"], FP32_TOL)
    stats = eng.stats()
    assert stats["spec_accepted_tokens"] > 50 and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["num_steps"] < plain.stats()["num_steps"]
    assert stats["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_output_is_unchanged_under_preemption(repeat_model, mode):
    """A KV pool too small for the batch forces preemption (recompute or swap) while
    sequences verify drafts: outputs equal the engine without speculation and HF."""
    ps = prompts(6, seed=3)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    cfg = dict(num_kv_blocks=24, block_size=8, max_num_batched_tokens=64, max_num_seqs=6, watermark=0.0,
               preemption_mode=mode, num_swap_blocks=64 if mode == "swap" else 0)
    arrivals = {0: [(f"r{i}", p, params) for i, p in enumerate(ps)]}
    want, _ = run(engine(repeat_model, 0, **cfg), arrivals)
    eng = engine(repeat_model, 3, **cfg)
    got, _ = run(eng, arrivals)
    assert got == want
    ref = load_reference(repeat_model)
    for i, p in enumerate(ps):
        assert_greedy_parity(ref, p, got[f"r{i}"], FP32_TOL)
    stats = eng.stats()
    assert stats["spec_accepted_tokens"] > 0
    assert stats["preemptions_" + mode] > 0


@pytest.mark.parametrize("cfg", [dict(dtype="bfloat16"), dict(dtype="bfloat16", quantization="int8"),
                                 dict(dtype="float32", quantization="int8")], ids=["bf16", "int8-bf16", "int8-fp32"])
def test_bf16_and_int8_output_with_speculation_equals_the_plain_run(repeat_model, cfg):
    """One request at a time, so a step verifies at most 1 + 3 rows, which every host's fused
    forward runs on its row-invariant kernels (csrc/linear_blocks.h; oneDNN only above
    BF16_KERNEL_MAX_ROWS where it is kept), with drafts attending as decode rows: bf16 and
    int8 output equals the run without speculation token for token, not merely bf16's noise."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, spec = engine(repeat_model, 0, **cfg), engine(repeat_model, 3, **cfg)
    for i, p in enumerate(prompts(4, seed=13)):
        want, _ = run(plain, {0: [(f"r{i}", p, params)]})
        got, _ = run(spec, {0: [(f"r{i}", p, params)]})
        assert got == want, i
    assert spec.stats()["spec_accepted_tokens"] > 20


def test_smollm2_bf16_output_with_speculation_equals_the_plain_run(default_model_dir, all_threads):
    """SmolLM2 in bf16 on both threads, two of bench.engine.speculative's chat prompts one at a
    time, 120 tokens: the same tokens with and without speculation. Where a row's sum depended
    on the rows sharing its call (the kernels' accumulator split per pass width, before
    2026-12-04) they parted at tokens 103 and 76 on the Zen 4 host."""
    from bench.engine.speculative import workloads

    def make(k: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=default_model_dir, dtype="bfloat16", num_speculative_tokens=k,
                                      num_kv_blocks=256))

    plain, spec = make(0), make(3)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(workloads(plain.tokenizer, 120)["chat"][:2]):
        want, _ = run(plain, {0: [(f"c{i}", prompt, params)]})
        got, _ = run(spec, {0: [(f"c{i}", prompt, params)]})
        assert got == want, (i, next(j for j, (a, b) in enumerate(zip(got[f"c{i}"], want[f"c{i}"])) if a != b))
    assert spec.stats()["spec_accepted_tokens"] > 5


def test_bf16_output_with_speculation_is_within_bf16_noise(repeat_model):
    """bf16, several streams: a step's rows can pass BF16_KERNEL_MAX_ROWS, above which a host
    with AMX or without AVX512-BF16 runs oneDNN, whose sums round otherwise than the kernel's;
    the contract is then bf16's own (tests/bf16.py): every token within the measured noise of
    fp32."""
    from tests.bf16 import assert_tokens_within_noise

    ps = prompts(3, seed=13)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    eng = engine(repeat_model, 4, dtype="bfloat16")
    got, _ = run(eng, staggered(ps, params))
    for i, p in enumerate(ps):
        assert_tokens_within_noise(repeat_model, p, got[f"r{i}"])
    assert eng.stats()["spec_accepted_tokens"] > 0


def test_stops_inside_an_accepted_run_end_where_the_plain_run_ends(repeat_model):
    """A stop token, a stop string and max_tokens that fall inside runs of accepted drafts
    end each request at the same token, with the same text and finish reason, as without
    speculation."""
    ps = prompts(3, seed=5)
    base = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain, _ = run(engine(repeat_model, 0), {0: [(f"r{i}", p, base) for i, p in enumerate(ps)]})
    tokenizer = engine(repeat_model, 0).tokenizer
    # Each request stops at the 6th token of its first run of six equal tokens.
    reqs = []
    for i, p in enumerate(ps):
        out = plain[f"r{i}"]
        j = max(range(5, len(out)), key=lambda j: len(set(out[j - 5:j + 1])) == 1)
        assert len(set(out[j - 5:j + 1])) == 1
        text = tokenizer.decode(out[j:j + 1])
        reqs += [(f"tok{i}", p, SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=(out[j],))),
                 (f"len{i}", p, SamplingParams(max_tokens=j + 1, temperature=0.0, ignore_eos=True)),
                 (f"str{i}", p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=(text,)))]
    results = []
    for k in (0, 4):
        eng = engine(repeat_model, k)
        tokens, reasons = run(eng, {0: reqs})
        results.append((tokens, reasons))
        if k:
            assert eng.stats()["spec_accepted_tokens"] > 0
    assert results[0] == results[1]


def test_seeded_sampling_is_reproducible_and_equals_the_plain_run(repeat_model):
    """temperature 0.1 (where the model's samples still repeat), seeded: the same tokens with speculation as without it (each token
    draws one uniform from the request's generator either way), in any batch composition."""
    ps = prompts(4, seed=9)
    outs = []
    for k, stagger in ((0, False), (4, False), (4, True)):
        reqs = [(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.1, seed=100 + i, ignore_eos=True))
                for i, p in enumerate(ps)]
        arrivals = {i * 2: [r] for i, r in enumerate(reqs)} if stagger else {0: reqs}
        eng = engine(repeat_model, k)
        outs.append(run(eng, arrivals)[0])
        if k:
            assert eng.stats()["spec_accepted_tokens"] > 0
    assert outs[0] == outs[1] == outs[2]


def test_rows_that_may_not_speculate_decode_beside_rows_that_do(repeat_model):
    """A logprobs row and a grammar-constrained row (which never propose) in a batch with a
    drafting row get the tokens and logprobs they get without speculation."""
    from engine import Grammar

    ps = prompts(3, seed=11)
    reqs = [("spec", ps[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
            ("lp", ps[1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)),
            ("re", ps[2], SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                         grammar=Grammar("regex", "(yes|no), [0-9]{1,3}!")))]
    seen = []
    for k in (0, 4):
        eng = engine(repeat_model, k)
        lps = []
        outputs = run_to_completion_logprobs(eng, reqs, lps)
        seen.append((outputs, [(lp.token_id, round(lp.logprob, 4)) for lp in lps]))
        if k:
            assert eng.stats()["spec_accepted_tokens"] > 0
    assert seen[0] == seen[1]


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


# -- configuration ----------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    (dict(num_speculative_tokens=-1), "EngineConfig.num_speculative_tokens"),
    (dict(num_speculative_tokens=17), "EngineConfig.num_speculative_tokens"),
    (dict(speculative_ngram_min=0), "EngineConfig.speculative_ngram_min"),
    (dict(speculative_ngram_min=3, speculative_ngram_max=2), "EngineConfig.speculative_ngram_max"),
    (dict(speculative_min_acceptance=1.5), "EngineConfig.speculative_min_acceptance"),
])
def test_speculative_fields_are_validated(bad, match):
    """Bad values raise ValueError naming the field."""
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_speculative_flags_reach_the_engine_config():
    """`--num-speculative-tokens` and the n-gram flags on serve/chat set the fields; absent, off."""
    import argparse

    from engine.config_cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).num_speculative_tokens == 0
    cfg = engine_config_from_args(p.parse_args(["--num-speculative-tokens", "5", "--speculative-ngram-min", "1",
                                                "--speculative-ngram-max", "3"]))
    assert (cfg.num_speculative_tokens, cfg.speculative_ngram_min, cfg.speculative_ngram_max) == (5, 1, 3)


def test_the_benchmark_runs_and_finds_the_same_tokens(repeat_model, tmp_path):
    """bench.engine.speculative end to end on the tiny model (fp32, 8 tokens, chat and json): a
    row each with both rates, the drafts counted and the same tokens with and without
    speculation; the schema-constrained json rows draft (the grammar forces the opening key)."""
    import json

    from bench.engine import speculative

    out = tmp_path / "spec.json"
    assert speculative.main(["--model", repeat_model, "--dtype", "float32", "--max-tokens", "8", "--only", "chat,json",
                             "--threads", "1", "--ngram-min", "1", "--json-out", str(out)]) == 0
    chat, structured = json.loads(out.read_text())["rows"]
    for row in (chat, structured):
        assert row["same_tokens"] and row["output_tokens"] > 0
        assert row["off_tok_s"][0] > 0 and row["on_tok_s"][0] > 0 and row["accepted"] <= row["drafted"]
    assert chat["workload"] == "chat" and structured["workload"] == "json" and structured["accepted"] > 0


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_families_keep_their_output(family, tmp_path, tokenizer_dir):
    """Mistral (every layer sliding over 24 tokens: blocks behind the window are returned)
    and Gemma 2 (alternating windows, soft-caps), as repeating tiny models: the same tokens
    with and without speculation, with drafts accepted."""
    import transformers

    from tests.families import _BASE, FAMILIES

    model_type, extra = FAMILIES[family]
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.AutoConfig.for_model(model_type, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id, pad_token_id=None,
                                               **{**_BASE, **extra, "initializer_range": 0.1,
                                                  "tie_word_embeddings": True})
    torch.manual_seed(1234)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ps = prompts(4, seed=17)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cfg = dict(max_num_batched_tokens=32, max_num_seqs=8, block_size=8)
    want, _ = run(engine(str(tmp_path), 0, **cfg), staggered(ps, params))
    eng = engine(str(tmp_path), 4, **cfg)
    got, _ = run(eng, staggered(ps, params))
    assert got == want
    assert eng.stats()["spec_accepted_tokens"] > 0

