"""The OpenAI/vLLM sampling surface (issue 27): penalties, logit_bias, min_p and logprobs,
each against a plain torch reference computed on the same logits; seeds that reproduce in
any batch; validation naming the field; unconstrained greedy rows unchanged beside them."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sampler import sample_step
from engine.sequence import Sequence
from tests.models import assert_greedy_parity, load_reference, run_to_completion

EPS = torch.finfo(torch.float32).eps
V = 64


def seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    s = Sequence("r", prompt, params)
    s.output_token_ids = list(output)
    return s


def reference_logits(logits: torch.Tensor, s: Sequence) -> torch.Tensor:
    """logit_bias, then repetition, then frequency/presence, written out token by token."""
    p, x = s.params, logits.clone()
    for t, b in p.logit_bias:
        x[t] = x[t] + b
    if p.repetition_penalty != 1.0:
        for t in set(s.prompt_token_ids) | set(s.output_token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(s.output_token_ids):
        c = s.output_token_ids.count(t)
        x[t] = x[t] - (c * p.frequency_penalty + p.presence_penalty)
    return x


def reference_logprobs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row is drawn from, in float64: greedy rows log-softmax(x); others
    temperature, then min_p, top-k and top-p (smallest prefix reaching top_p), renormalised."""
    x = x.double()
    if p.greedy:
        return x.log_softmax(-1)
    x = x / p.temperature
    probs = x.softmax(-1)
    keep = probs >= p.min_p * probs.max()
    order = sorted(range(len(x)), key=lambda t: -x[t].item())
    if p.top_k:
        for t in order[p.top_k:]:
            keep[t] = False
    kept = [t for t in order if keep[t]]
    mass = x.masked_fill(~keep, float("-inf")).softmax(-1)
    total = 0.0
    for t in kept:
        if total >= p.top_p:
            keep[t] = False
        total += mass[t].item()
    return x.masked_fill(~keep, float("-inf")).log_softmax(-1)


CASES = [
    SamplingParams(temperature=0.0, logit_bias={3: 5.5, 7: -100, 60: 0.25}, logprobs=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.7, logprobs=3),
    SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=0.7, presence_penalty=-0.4, logprobs=0),
    SamplingParams(temperature=0.7, frequency_penalty=1.5, presence_penalty=2.0, logprobs=4, seed=1),
    SamplingParams(temperature=1.3, min_p=0.08, logprobs=20, seed=2),
    SamplingParams(temperature=0.9, min_p=0.02, top_k=12, top_p=0.8, logit_bias={1: 3.0}, repetition_penalty=1.2,
                   logprobs=6, seed=3),
]


def test_processed_logprobs_match_a_torch_reference_on_the_same_logits():
    """Every case in one batch (and beside two plain rows): each row's reported logprobs
    are the reference's (within fp32 rounding of its scale), the chosen token is the
    reference's argmax for greedy rows and inside the reference's support otherwise, and
    the top lists are the reference's largest, most likely first."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for trial in range(20):
        logits = torch.randn(len(CASES) + 2, V, generator=gen) * 3
        seqs = [seq(p, [rng.randrange(V) for _ in range(6)], [rng.randrange(V) for _ in range(rng.randrange(12))])
                for p in CASES]
        plain = [seq(SamplingParams(temperature=0.0), [1, 2], []),
                 seq(SamplingParams(temperature=1.0, seed=4), [1], [])]
        batch = seqs[:3] + plain + seqs[3:]
        rows = list(range(3)) + list(range(5, len(batch)))
        tokens, logprobs = sample_step(logits[[0, 1, 2, 6, 7, 3, 4, 5]], batch)
        assert logprobs[3] is None and logprobs[4] is None
        assert tokens[3] == int(logits[6].argmax())
        for case, (i, s) in enumerate(zip(rows, seqs)):
            x = reference_logits(logits[case], s)
            ref = reference_logprobs(x, s.params)
            scale = float(x.abs().max()) / (s.params.temperature or 1.0) + 5
            lp = logprobs[i]
            assert lp.token_id == tokens[i] and ref[tokens[i]] > float("-inf")
            if s.params.greedy:
                assert tokens[i] == int(x.argmax())
            assert abs(lp.logprob - ref[tokens[i]].item()) <= 16 * EPS * scale, (trial, case)
            k = s.params.logprobs
            assert len(lp.top) == min(k, int((ref > float("-inf")).sum()))
            want = ref.topk(len(lp.top)).values.tolist()
            assert [v for _, v in lp.top] == pytest.approx(want, abs=16 * EPS * scale)
            assert all(abs(ref[t].item() - v) <= 16 * EPS * scale for t, v in lp.top)


def test_logit_bias_can_ban_or_force_a_token():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    best = int(logits[0].argmax())
    banned = seq(SamplingParams(temperature=0.0, logit_bias={best: -100}), [1], [])
    forced = seq(SamplingParams(temperature=2.0, logit_bias={17: 100}, seed=0), [1], [])
    for _ in range(50):
        tokens, _ = sample_step(logits, [banned, forced])
        assert tokens[0] != best and tokens[1] == 17


def test_min_p_draws_follow_the_reference_distribution():
    """3000 seeded draws under temperature and min_p: every token inside the reference's
    support, frequencies within 0.03 of its probabilities."""
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]]))
    s = seq(SamplingParams(temperature=1.5, min_p=0.3, seed=11), [0], [])
    ref = reference_logprobs(logits[0], s.params).exp()
    counts = torch.zeros(6, dtype=torch.float64)
    for _ in range(3000):
        counts[sample_step(logits, [s])[0][0]] += 1
    assert counts[ref == 0].sum() == 0 and (ref == 0).any()
    assert torch.allclose(counts / 3000, ref, atol=0.03)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, max_num_seqs=8,
                                  max_model_len=512, num_kv_blocks=256))


def run(engine, requests: dict[int, list[tuple]]):
    logprobs: dict[str, list] = {}
    real = engine.step

    def step():
        outs = real()
        for o in outs:
            assert o.logprobs is None or len(o.logprobs) == len(o.new_token_ids)
            logprobs.setdefault(o.request_id, []).extend(o.logprobs or [])
        return outs

    engine.step = step
    try:
        return run_to_completion(engine, requests), logprobs
    finally:
        del engine.step


def test_seeded_requests_reproduce_in_any_batch(engine):
    """A seeded request (penalties, min_p, logprobs) gives the same tokens and logprobs
    alone, beside plain and processed rows, and arriving mid-stream of others."""
    rng = random.Random(3)
    prompt = [rng.randrange(100, 40_000) for _ in range(20)]
    target = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=99, presence_penalty=0.5,
                            min_p=0.01, logprobs=3, ignore_eos=True)
    alone, lp_alone = run(engine, {0: [("t", prompt, target)]})
    others = [(f"o{i}", [rng.randrange(100, 40_000) for _ in range(rng.randrange(5, 60))],
               SamplingParams(max_tokens=25, temperature=[0.0, 1.0, 0.7][i % 3], seed=i, logprobs=[None, 2][i % 2],
                              frequency_penalty=0.3 * (i % 2), ignore_eos=True)) for i in range(6)]
    for arrivals in ({0: others + [("t", prompt, target)]}, {0: others[:3], 2: [("t", prompt, target)], 4: others[3:]}):
        got, lp = run(engine, arrivals)
        assert got["t"] == alone["t"]
        assert [x.token_id for x in lp["t"]] == alone["t"]
        assert [x.logprob for x in lp["t"]] == pytest.approx([x.logprob for x in lp_alone["t"]], abs=1e-4)


def test_logprobs_match_hf_teacher_forced(engine, tiny_model):
    """Greedy with logprobs=5: each token's logprob and top 5 are HF's log-softmax at that
    position (fp32 tolerance of the parity tests), the top list led by the chosen token."""
    prompt = [5, 900, 31, 77, 4000, 12]
    out, lp = run(engine, {0: [("g", prompt, SamplingParams(max_tokens=12, temperature=0.0, logprobs=5,
                                                             ignore_eos=True))]})
    model = load_reference(tiny_model("llama"))
    with torch.inference_mode():
        ref = model(torch.tensor([prompt + out["g"]])).logits[0].float().log_softmax(-1)
    for i, (tok, x) in enumerate(zip(out["g"], lp["g"])):
        row = ref[len(prompt) + i - 1]
        assert x.token_id == tok and x.top[0][0] == tok
        assert x.logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert [v for _, v in x.top] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)


def test_plain_greedy_rows_keep_parity_beside_processed_rows(engine, tiny_model):
    """Unconstrained greedy rows equal HF greedy while penalised, biased and sampled rows
    share their batches; penalised greedy rows differ from plain greedy where they should."""
    rng = random.Random(8)
    prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in (9, 33, 17, 50)]
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("p0", prompts[0], plain),
                    ("x0", prompts[1], SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=5.0,
                                                      logprobs=1, ignore_eos=True))],
                1: [("p1", prompts[2], plain),
                    ("x1", prompts[3], SamplingParams(max_tokens=20, temperature=1.0, seed=1, logit_bias={100: 10},
                                                      min_p=0.1, ignore_eos=True))]}
    out, _ = run(engine, arrivals)
    ref = load_reference(tiny_model("llama"))
    assert_greedy_parity(ref, prompts[0], out["p0"], 1e-4)
    assert_greedy_parity(ref, prompts[2], out["p1"], 1e-4)
    assert len(set(out["x0"])) == len(out["x0"])           # repetition penalty 5: no repeats on this model
    assert out["x1"].count(100) >= 10                       # +10 on a random model's logits dominates


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={10**9: 1}), "logit_bias"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logit_bias={i: 1 for i in range(1025)}), "logit_bias"),
    (dict(min_p=-0.1), "min_p"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(grammar="{}"), "grammar"),
])
def test_bad_sampling_fields_are_refused_naming_the_field(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", [1, 2], SamplingParams(**kwargs))
    assert not engine.has_unfinished()


def test_logit_bias_accepts_a_dict_with_string_keys():
    p = SamplingParams(logit_bias={"50": -100, 7: 2.5})
    assert p.logit_bias == ((7, 2.5), (50, -100))
    p.validate(100)


def test_merged_outputs_keep_logprobs_aligned_with_tokens():
    """A slow consumer's merged delta carries every token's logprob in order; the final
    output (no tokens, no logprobs) leaves them as they were."""
    from engine import RequestOutput, TokenLogprob

    a = RequestOutput("r", [5], "a", logprobs=[TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.0)))])
    b = RequestOutput("r", [6, 7], "bc", logprobs=[TokenLogprob(6, -0.1), TokenLogprob(7, -2.0)])
    end = RequestOutput("r", [], "", finished=True, finish_reason="stop")
    merged = a.merge(b).merge(end)
    assert merged.new_token_ids == [5, 6, 7] and merged.finished
    assert [x.token_id for x in merged.logprobs] == merged.new_token_ids
    assert merged.logprobs[0].top == ((5, -0.5), (6, -1.0))
    assert RequestOutput("r", [1], "x").merge(end).logprobs is None


def test_n_choices_of_one_prompt_compute_it_once(tiny_model):
    """Four requests with the same 100-token prompt arriving together (the gateway's `n`):
    the first computes the prompt, the others wait for its blocks and take them from the
    prefix cache (only the last, partial block is computed again); greedy choices agree,
    seeded ones differ. With prefix caching off, all four compute it."""
    prompt = [random.Random(2).randrange(100, 40_000) for _ in range(100)]
    for caching in (True, False):
        eng = LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, max_num_seqs=8,
                                     num_kv_blocks=256, enable_prefix_caching=caching))
        reqs = [(f"c{i}", prompt, SamplingParams(max_tokens=8, temperature=0.0 if i < 2 else 1.0, seed=i,
                                                 ignore_eos=True)) for i in range(4)]
        out = run_to_completion(eng, {0: reqs})
        computed = eng.scheduler.counters.prompt_tokens
        if caching:
            assert computed == 100 + 3 * (100 - 96)                 # 6 full blocks of 16 shared
            assert eng.stats()["prefix_cache_hit_tokens"] == 3 * 96
        else:
            assert computed == 4 * 100
        assert out["c0"] == out["c1"] and out["c2"] != out["c3"]
