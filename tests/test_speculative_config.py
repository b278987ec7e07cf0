"""Speculative decoding's configuration (fields, CLI flags), its benchmark end to end, and
the sliding-window families with speculation on."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SamplingParams
from tests.speculative_util import engine, prompts, run, staggered


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


def test_a_step_decoding_more_rows_than_the_limit_proposes_nothing(repeat_model):
    """speculative_disable_by_batch_size = 2 (vLLM's flag): while three sequences decode, no
    row carries drafts; once one has ended, the two left propose again. The tokens are the
    plain run's either way."""
    ps = prompts(3, seed=5)
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=20 + 25 * i, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(ps)]
    want, _ = run(engine(repeat_model, 0), {0: reqs})
    eng = engine(repeat_model, 4, speculative_disable_by_batch_size=2)
    for rid, p, params in reqs:
        eng.add_request(rid, p, params)
    got: dict[str, list[int]] = {}
    drafted_wide = drafted_narrow = 0
    while eng.has_unfinished():
        decoding = sum(1 for s in eng.scheduler.running if not s.computes_prompt)
        before = eng.stats()["spec_verified_rows"]
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        rows = eng.stats()["spec_verified_rows"] - before
        if decoding > 2:
            drafted_wide += rows
        else:
            drafted_narrow += rows
    assert got == want
    assert drafted_wide == 0 and drafted_narrow > 0


def test_the_batch_limit_is_validated_and_reaches_the_cli():
    with pytest.raises(ValueError, match="EngineConfig.speculative_disable_by_batch_size"):
        EngineConfig(speculative_disable_by_batch_size=0)
    import argparse

    from engine.config_cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).speculative_disable_by_batch_size is None
    args = p.parse_args(["--speculative-disable-by-batch-size", "16"])
    assert engine_config_from_args(args).speculative_disable_by_batch_size == 16
