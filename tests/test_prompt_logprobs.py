"""Prompt logprobs (engine/prompt_logprobs.py): each prompt token's log-probability given the
ones before it and the top k, from the prefill's logits — equal to the log-softmax of HF's
forward over the prompt (fp32 tolerance of the logprobs tests), with the prompt cut into
chunks, beside other requests, after a prefix-cache hit was possible (it is skipped), under
preemption by recompute, and with max_tokens 0 (the prompt scored, nothing generated)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, Grammar, LLMEngine, SamplingParams
from engine.kernels import paged_attention_ops
from tests.models import load_reference

K = 5


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, max_num_seqs=8,
                                  max_model_len=512, num_kv_blocks=256))


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(5)
    return [rng.randrange(100, 40_000) for _ in range(150)]         # three chunks of <= 64


@pytest.fixture(scope="module")
def reference(tiny_model, prompt):
    model = load_reference(tiny_model("llama"))
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)      # [P, V]


def run(engine, arrivals: dict[int, list[tuple]]) -> dict[str, list]:
    """Step until done; each request's outputs."""
    outs: dict[str, list] = {}
    step = 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for rid, p, params in arrivals.get(step, []):
            engine.add_request(rid, p, params)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
        assert step < 2_000
    return outs


def check(lps, prompt, reference) -> None:
    assert len(lps) == len(prompt) and lps[0] is None
    for p in range(1, len(prompt)):
        row, x = reference[p - 1], lps[p]
        assert x.token_id == prompt[p]
        assert x.logprob == pytest.approx(row[prompt[p]].item(), abs=1e-4)
        assert [v for _, v in x.top] == pytest.approx(row.topk(K).values.tolist(), abs=1e-4)
        assert [t for t, _ in x.top] == row.topk(K).indices.tolist()


def prompt_logprobs(outs: list) -> list:
    given = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(given) == 1, "prompt logprobs come exactly once"
    return given[0]


def test_chunked_beside_others_and_after_a_cacheable_run(engine, prompt, reference):
    """Chunked and batched with a decoding request: exact; then once more after the same prompt
    filled the prefix cache: the cache is skipped and the list is whole and the same; the
    generated tokens are those of a run without prompt logprobs."""
    other = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    asked = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    outs = run(engine, {0: [("o", [7, 8, 9], other)], 2: [("a", prompt, asked)]})
    check(prompt_logprobs(outs["a"]), prompt, reference)
    assert prompt_logprobs(outs["a"]) is outs["a"][0].prompt_logprobs      # with the first token
    plain = run(engine, {0: [("plain", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]})
    hits = engine.block_manager.prefix_hit_tokens
    again = run(engine, {0: [("again", prompt, asked)]})
    assert engine.block_manager.prefix_hit_tokens == hits
    check(prompt_logprobs(again["again"]), prompt, reference)
    tokens = [t for o in again["again"] for t in o.new_token_ids]
    assert tokens == [t for o in plain["plain"] for t in o.new_token_ids] == \
        [t for o in outs["a"] for t in o.new_token_ids]


def test_max_tokens_zero_scores_the_prompt_only(engine, prompt, reference):
    """max_tokens 0: one final output, finish 'length', no token, no text, the prompt's logprobs."""
    outs = run(engine, {0: [("z", prompt, SamplingParams(max_tokens=0, prompt_logprobs=K))]})["z"]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 0
    assert not any(o.new_token_ids or o.new_text for o in outs)
    check(prompt_logprobs(outs), prompt, reference)


def test_recompute_after_preemption_records_nothing_twice(tiny_model, prompt, reference):
    """A KV pool too small for both: preempted (recompute) mid-flight, the list stays exact."""
    eng = LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, max_num_seqs=4,
                                 max_model_len=512, num_kv_blocks=26, block_size=16, preemption_mode="recompute"))
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    asked = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    outs = run(eng, {0: [("a", prompt, asked), ("b", prompt[::-1][:100], long)]})
    assert eng.scheduler.counters.preemptions > 0
    check(prompt_logprobs(outs["a"]), prompt, reference)


@pytest.mark.parametrize("params, field", [
    (dict(prompt_logprobs=21), "prompt_logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=0, prompt_logprobs=1, grammar=Grammar("json_object")), "grammar"),
])
def test_validation_names_the_field(params, field):
    """Out-of-range prompt_logprobs, max_tokens 0 without them or with a grammar: refused naming the field."""
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**params).validate(100)


@pytest.mark.slow
@pytest.mark.skipif(paged_attention_ops() is None,
                    reason="the paged attention kernel did not build: compiled steps take the torch backend, unpadded")
def test_compiled_runner_with_padding_rows(tiny_model, prompt, reference):
    """torch.compile with the kernel pads every step with two scratch rows after the kept
    logits: the prompt rows stay between the sampled rows and the padding."""
    eng = LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, max_num_seqs=4,
                                 max_model_len=512, num_kv_blocks=64, compile=True))
    assert eng.runner.pad_rows
    outs = run(eng, {0: [("a", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                      prompt_logprobs=K))]})
    check(prompt_logprobs(outs["a"]), prompt, reference)
