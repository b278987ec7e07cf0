"""LLMEngine behaviour on a tiny model: bad input, stops, sampling, errors inside a step."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, max_num_seqs=8,
                                  max_model_len=256, num_kv_blocks=256))


def drain(engine) -> dict:
    """Step until idle; returns {request_id: (token ids, text, finish_reason, n_final_events)}."""
    res: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks, text, reason, n = res.get(o.request_id, ([], "", None, 0))
            res[o.request_id] = (toks + o.new_token_ids, text + o.new_text,
                                 o.finish_reason if o.finished else reason, n + o.finished)
    return res


G = SamplingParams(max_tokens=5, temperature=0.0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt_token_ids=[]), "prompt_token_ids"),
    (dict(prompt_token_ids=list(range(1, 300))), "prompt_token_ids"),
    (dict(prompt_token_ids=[10**9]), "prompt_token_ids"),
    (dict(params=SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(params=SamplingParams(max_tokens=-3)), "max_tokens"),
    (dict(params=SamplingParams(temperature=-0.1)), "temperature"),
    (dict(params=SamplingParams(top_p=0.0)), "top_p"),
    (dict(params=SamplingParams(top_p=1.5)), "top_p"),
    (dict(params=SamplingParams(top_k=-1)), "top_k"),
])
def test_bad_input_raises_naming_the_field_and_leaves_others_untouched(engine, kwargs, field):
    """Each bad value raises ValueError naming its field at add_request; a request already
    queued still runs to completion."""
    engine.add_request("ok", [5, 6, 7], G)
    args = dict(request_id="bad", prompt_token_ids=[1, 2, 3], params=G) | kwargs
    with pytest.raises(ValueError, match=field):
        engine.add_request(args.pop("request_id"), args.pop("prompt_token_ids"), args.pop("params"))
    res = drain(engine)
    assert set(res) == {"ok"} and res["ok"][2] == "length" and len(res["ok"][0]) == 5


def test_duplicate_request_id_is_rejected(engine):
    """A request id in use raises ValueError naming request_id; the first one is unaffected."""
    engine.add_request("dup", [5, 6, 7], G)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", [8, 9], G)
    res = drain(engine)
    assert len(res["dup"][0]) == 5 and res["dup"][3] == 1


def test_abort_unknown_is_noop_and_abort_frees_blocks(engine):
    """Aborting an unknown id does nothing; aborting a running request frees its blocks and
    yields exactly one final 'abort' output."""
    engine.abort("nobody")
    engine.add_request("a", list(range(10, 60)), SamplingParams(max_tokens=100, temperature=0.0))
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    engine.abort("a")
    assert engine.stats()["kv_blocks_used"] == 0
    res = drain(engine)
    assert res["a"][2] == "abort" and res["a"][3] == 1


def test_stop_token_ids_and_max_model_len(engine):
    """A stop token ends with 'stop' (the token is reported, not rendered); reaching
    max_model_len ends with 'length'."""
    engine.add_request("probe", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    first = drain(engine)["probe"][0][0]
    engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(first,)))
    engine.add_request("long", list(range(1, 250)), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    res = drain(engine)
    assert res["s"][0] == [first] and res["s"][2] == "stop" and res["s"][1] == ""
    assert res["long"][2] == "length" and len(res["long"][0]) == 256 - 249


def test_stop_string_is_not_emitted(engine):
    """Generation stops at a stop string; the text before it is emitted, the string is not."""
    engine.add_request("free", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    text = drain(engine)["free"][1]
    assert len(text) > 6
    stop = text[4:6]
    engine.add_request("cut", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,), ignore_eos=True))
    res = drain(engine)["cut"]
    assert res[2] == "stop" and res[1] == text[:text.index(stop)]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    """The same seed gives the same tokens alone and beside other requests; top-k=1 is greedy."""
    p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    engine.add_request("alone", [5, 6, 7], p)
    alone = drain(engine)["alone"][0]
    engine.add_request("x", [9, 9, 9, 9], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    engine.add_request("again", [5, 6, 7], p)
    engine.add_request("topk1", [5, 6, 7], SamplingParams(max_tokens=8, temperature=5.0, top_k=1, ignore_eos=True))
    engine.add_request("greedy", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    res = drain(engine)
    assert res["again"][0] == alone
    assert res["topk1"][0] == res["greedy"][0]


def test_sampling_follows_the_distribution():
    """top-p keeps the smallest set reaching p; draws match the renormalised probabilities."""
    from engine.sampler import _filtered_probs

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = _filtered_probs(logits, torch.tensor([0]), torch.tensor([0.8]))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = _filtered_probs(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert torch.allclose(probs[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95) and probs[0, 3] == 0
    # No cut: the plain softmax. Rows with different cuts in one call: each gets its own.
    assert torch.allclose(_filtered_probs(logits, torch.tensor([0]), torch.tensor([1.0])), logits.softmax(-1))
    rows = logits.repeat(3, 1)[:, [3, 1, 0, 2]]                    # shuffled: sort order matters
    probs = _filtered_probs(rows, torch.tensor([2, 0, 0]), torch.tensor([1.0, 1.0, 0.8]))
    assert torch.allclose(probs, torch.tensor([[0.0, 0.375, 0.625, 0.0],
                                               [0.05, 0.3, 0.5, 0.15],
                                               [0.0, 0.375, 0.625, 0.0]]))


def test_sampled_tokens_follow_the_filtered_distribution():
    """sample() draws each token with its filtered probability (4000 seeded draws within
    0.03), never a token the cut removed, and greedy rows take the argmax."""
    from types import SimpleNamespace

    from engine.sampler import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    seq = SimpleNamespace(params=SamplingParams(temperature=1.0, top_p=0.95, seed=3), generator=None)
    greedy = SimpleNamespace(params=SamplingParams(temperature=0.0), generator=None)
    counts = torch.zeros(4)
    for _ in range(4000):
        token, best = sample(logits, [seq, greedy])
        counts[token] += 1
        assert best == 3
    assert counts[3] == 0                                          # cut by top-p 0.95
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.03)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_batch_of_drawing_rows_draws_what_each_draws_beside_a_greedy_row(temperature):
    """sampler's plain path skips the greedy pass and the copy of the rows when every row draws,
    and the division at temperature 1: each seeded row's tokens equal those it draws in a batch
    that also holds a greedy row (the path that copies the drawing rows out)."""
    from engine.sampler import sample
    from engine.sequence import Sequence

    torch.manual_seed(4)
    logits = torch.randn(6, 4, 500) * 2

    def seqs(greedy_at: int | None) -> list[Sequence]:
        out = [Sequence(f"r{i}", [1], SamplingParams(temperature=temperature, seed=i)) for i in range(4)]
        if greedy_at is not None:
            out.insert(greedy_at, Sequence("g", [1], SamplingParams(temperature=0.0)))
        return out

    alone, mixed = seqs(None), seqs(2)
    for step in logits:
        got = sample(step, alone)
        with_greedy = sample(torch.cat([step[:2], step[:1], step[2:]]), mixed)
        assert got == with_greedy[:2] + with_greedy[3:]
        assert with_greedy[2] == int(step[0].argmax())


def test_greedy_takes_argmax_first_index_on_ties_nan_and_all_masked_rows():
    """sampler.greedy (torch's max(dim), faster on CPU) picks the index argmax picks: the first of
    tied maxima, a NaN as the maximum, index 0 of a fully masked row; on random [32, V] logits too."""
    from engine.sampler import greedy

    inf = float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 1.0, float("nan"), 2.0], [-inf] * 4, [2.0] * 4,
                      [-1.0, -inf, 5.0, 5.0]])
    assert greedy(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 0, 0, 2]
    y = torch.randn(32, 4096, generator=torch.Generator().manual_seed(0)).round(decimals=1)   # many ties
    assert torch.equal(greedy(y), y.argmax(dim=-1))


def test_exception_in_step_fails_that_batch_and_engine_keeps_serving(engine, monkeypatch):
    """A fault inside the forward pass ends that step's requests with 'error', frees their
    blocks, and later requests are served normally."""
    real = engine.runner.run
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "run", flaky)
    engine.add_request("victim", list(range(10, 40)), SamplingParams(max_tokens=20, temperature=0.0))
    res = drain(engine)
    assert res["victim"][2] == "error" and res["victim"][3] == 1
    assert engine.stats()["kv_blocks_used"] == 0
    engine.add_request("after", [5, 6, 7], G)
    assert drain(engine)["after"][2] == "length"


def test_unsupported_model_family_is_named(tmp_path):
    """A model family the paged engine cannot run fails with a clear error naming it."""
    import transformers

    transformers.BloomConfig(n_layer=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="bloom"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_config_validation_names_the_field():
    """Invalid engine settings raise ValueError naming the field."""
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="policy"):
        EngineConfig(policy="random")
