"""bench/engine/roofline.py: the bounds' arithmetic on a tiny config with injected rates (no timing in
the verdict), and the script end to end with tiny repeat counts."""

from __future__ import annotations

import json

import pytest

from bench.engine.roofline import Rates, Shapes, bounds, decode_step_s, fractions, main, prefill_s, serving_tok_s

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=1000)
RATES = Rates(flops=1e11, bandwidth=1e10)


def test_linear_params_count_the_models_own_linear_weights():
    """Shapes.linear_params equals the numel of every nn.Linear weight of the transformers model
    built from the same config (lm_head included)."""
    import transformers
    from torch import nn

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG, tie_word_embeddings=False))
    numel = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert Shapes.from_config(CFG).linear_params == numel


def test_one_row_decode_is_weight_bytes_over_bandwidth():
    """One row, no context: bytes / bandwidth; doubling bandwidth halves it, halving the weight
    bytes (bf16 -> int8) halves it, and the compute rate does not enter."""
    s = Shapes.from_config(CFG)
    t = decode_step_s(s, RATES, 1, 2)
    assert t == pytest.approx(s.linear_params * 2 / RATES.bandwidth)
    assert decode_step_s(s, Rates(RATES.flops, 2 * RATES.bandwidth), 1, 2) == pytest.approx(t / 2)
    assert decode_step_s(s, RATES, 1, 1) == pytest.approx(t / 2)
    assert decode_step_s(s, Rates(RATES.flops * 10, RATES.bandwidth), 1, 2) == pytest.approx(t)


def test_batched_decode_turns_compute_bound_with_rows():
    """B rows: max(bytes / bandwidth, B x FLOPs / throughput): flat while memory-bound, then
    linear in B; the crossover is where B x 2 flops/param / FLOP/s = bytes/param / bandwidth."""
    s = Shapes.from_config(CFG)
    crossover = RATES.flops * 2 / (2 * RATES.bandwidth)                   # bf16: 2 bytes, 2 FLOPs per param
    assert decode_step_s(s, RATES, int(crossover // 2), 2) == pytest.approx(decode_step_s(s, RATES, 1, 2))
    big = int(crossover * 4)
    assert decode_step_s(s, RATES, big, 2) == pytest.approx(big * 2 * s.linear_params / RATES.flops)
    assert decode_step_s(s, RATES, 2 * big, 2) == pytest.approx(2 * decode_step_s(s, RATES, big, 2))
    assert decode_step_s(s, RATES, 1, 2, context=100) > decode_step_s(s, RATES, 1, 2)   # KV reads count


def test_prefill_is_flops_over_throughput():
    """A chunk: its FLOPs / throughput (doubling throughput halves it; bandwidth does not enter);
    the lm_head is paid once per prompt, not per token."""
    s = Shapes.from_config(CFG)
    t = prefill_s(s, RATES, 512)
    assert prefill_s(s, Rates(2 * RATES.flops, RATES.bandwidth), 512) == pytest.approx(t / 2)
    assert prefill_s(s, Rates(RATES.flops, 9 * RATES.bandwidth), 512) == pytest.approx(t)
    layers_only = 512 * 2.0 * s.layers * s.layer_params / RATES.flops
    lm_head = 2.0 * s.vocab * s.hidden / RATES.flops
    attention = 512 * s.attention_flops(256.5) / RATES.flops
    assert t == pytest.approx(layers_only + lm_head + attention)


def test_serving_bound_limits():
    """With unlimited compute the serving bound is N x bandwidth / bytes read per step (plus the
    KV); more streams raise it; a measured figure's fraction is measured / bound."""
    s = Shapes.from_config(CFG)
    fast = Rates(flops=1e30, bandwidth=RATES.bandwidth)
    tok = serving_tok_s(s, fast, 4, 10, 8, 2, kv_bytes=0)
    assert tok == pytest.approx(4 * RATES.bandwidth / (s.linear_params * 2))
    b = bounds(s, RATES, 2, [1, 8], [1, 8], 286, 64)
    assert b["serving_tok_s"]["8"] > b["serving_tok_s"]["1"]
    assert fractions(b["serving_tok_s"], {"1": b["serving_tok_s"]["1"] / 2}) == {"1": pytest.approx(0.5)}


def test_script_runs_end_to_end(tiny_model, tmp_path, capsys):
    """`python -m bench.engine.roofline` on a tiny model with tiny repeat counts writes its JSON with
    positive rates, every bound, and the measured fraction."""
    out = tmp_path / "roofline.json"
    assert main(["--model", tiny_model("llama"), "--reps", "1", "--rows", "1,8", "--bandwidth-mb", "8",
                 "--no-isa-probe", "--measured", "1=5", "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["read_bandwidth"] > 0 and all(v > 0 for v in res["matmul_flops"]["bfloat16"].values())
    assert set(res["bounds"]["serving_tok_s"]) == {"1", "8", "32"}
    assert res["fraction_of_bound"]["1"] == pytest.approx(5 / res["bounds"]["serving_tok_s"]["1"])
    assert "CPU:" in capsys.readouterr().out
