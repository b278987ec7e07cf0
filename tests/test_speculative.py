"""Speculative decoding without a draft model (engine/speculative.py, engine/spec_decode.py):
n-gram proposals, the acceptance rule against torch's distribution, and the engine's
output with speculation equal to HF generate and to the engine without it, under staggered
arrivals, chunked prefill, prefix caching, preemption (recompute and swap), stop tokens,
stop strings and lengths inside accepted runs, and seeded sampling.

The model is a tiny random Llama with tied embeddings and initializer_range 0.1: its greedy
output falls into runs of one repeated token broken by context-dependent changes, so
proposals are both accepted and rejected (each test asserts acceptances > 0).
Grammar-constrained rows: tests/test_speculative_grammar.py; the configuration, the benchmark
and the sliding-window families: tests/test_speculative_config.py."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import SamplingParams as SP
from engine.sequence import Sequence
from engine.spec_decode import verify
from engine.speculative import NgramIndex, Speculator, plain_sampling
from tests.models import assert_greedy_parity, load_reference
from tests.speculative_util import engine, prompts, run, run_to_completion_logprobs, staggered

FP32_TOL = 1e-4


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
