"""`batching="static"` (kept for benchmarks): a batch admits requests only until its first
token and runs to completion before the next batch starts; outputs stay greedy-exact."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams


def test_static_batching_waits_for_the_batch_and_keeps_outputs(tiny_model):
    """A request arriving mid-batch starts only after the batch ends, with the same tokens as continuous."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = {"a": [11, 12, 13], "b": [21, 22, 23, 24], "late": [31, 32]}
    outputs = {}
    for mode in ("continuous", "static"):
        eng = LLMEngine(EngineConfig(model=tiny_model("llama"), batching=mode, max_num_batched_tokens=64,
                                      num_kv_blocks=256))
        eng.add_request("a", prompts["a"], params)
        eng.add_request("b", prompts["b"], params)
        toks = {k: [] for k in prompts}
        late_started_with = None
        step = 0
        while eng.has_unfinished():
            if step == 2:
                eng.add_request("late", prompts["late"], params)
            for out in eng.step():
                toks[out.request_id] += out.new_token_ids
                if out.request_id == "late" and late_started_with is None:
                    late_started_with = {k: len(toks[k]) for k in ("a", "b")}
            step += 1
        outputs[mode] = toks
        if mode == "static":
            assert late_started_with == {"a": 6, "b": 6}
        else:
            assert late_started_with["a"] < 6
    assert outputs["static"] == outputs["continuous"]


def test_batching_is_validated():
    """An unknown batching mode names the field."""
    with pytest.raises(ValueError, match="batching"):
        EngineConfig(batching="dynamic")
