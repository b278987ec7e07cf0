"""The fused Llama forward (engine/fused_llama.py) and its C++ operators (csrc/layers.cpp):
each operator against transformers' own module math, the forward's logits against
transformers' on a packed batch, and when the runner uses it. Greedy parity with HF
`generate` through the engine is in tests/test_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine.config import EngineConfig
from engine.fused_llama import FusedLlama, linear_kind
from engine.kernels import load_kernels
from tests.bf16 import assert_tensor_within_noise
from engine.model_runner import ModelRunner
from engine.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(not load_kernels(), reason="the C++ kernels did not build (see the log)")
ops = torch.ops.streamgate


def test_rms_norm_and_residual_add_match_transformers():
    """rms_norm is LlamaRMSNorm; add_rms_norm adds x into the residual in place first, on a
    row-strided input as the fused forward passes it."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(40, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(7, 80)[:, :40]                                # row stride 80
    residual = torch.randn(7, 40)
    with torch.inference_mode():
        torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-5)
        expected_residual = residual + x
        out = ops.add_rms_norm(x, residual, norm.weight, 1e-5)
        torch.testing.assert_close(residual, expected_residual)
        torch.testing.assert_close(out, norm(expected_residual), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [16, 64, 84])
def test_rotary_in_place_matches_transformers(d):
    """rotary applies apply_rotary_pos_emb to q [N, H, D] and k [N, H_kv, D] in place, views
    into one fused q/k/v row as the fused forward has them, at SmolLM2's head size (64), a small
    one (16) and one whose half is no multiple of 8 (84)."""
    torch.manual_seed(1)
    n, h, hkv = 5, 4, 2
    qkv = torch.randn(n, (h + 2 * hkv) * d)
    q, k = qkv[:, :h * d].view(n, h, d), qkv[:, h * d:(h + hkv) * d].view(n, hkv, d)
    angles = torch.rand(n, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    v_before = qkv[:, (h + hkv) * d:].clone()
    ops.rotary(q, k, cos, sin)
    torch.testing.assert_close(q, ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (h + hkv) * d:], v_before)           # v untouched


@pytest.mark.parametrize("width", [24, 27])
def test_silu_and_mul_matches_torch(width):
    """silu_and_mul(gate ++ up) is silu(gate) * up (eight lanes at a time, then the rest)."""
    torch.manual_seed(2)
    gate_up = torch.randn(3, 2 * width) * 8
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(ops.silu_and_mul(gate_up), want, rtol=1e-5, atol=1e-6)
    if width % 8 == 0:            # gate and up alternating in blocks (the fused forward's layout, by 16)
        blocked = torch.stack([gate_up[:, :width].reshape(3, -1, 8), gate_up[:, width:].reshape(3, -1, 8)], 2).reshape(3, -1)
        torch.testing.assert_close(ops.silu_and_mul(blocked, 8), want, rtol=1e-5, atol=1e-6)


def test_runner_fuses_llama_by_default_and_not_when_off(tiny_model):
    """A Llama model on CPU fp32 runs the fused forward, its weights held once (q/k/v and
    gate/up fused, no nn.Linear left); fused_layers=False or packed_linear=False keeps
    transformers' forward; Qwen2, Llama-shaped with q/k/v biases, is fused too (families.py)."""
    runner = ModelRunner(EngineConfig(model=tiny_model("llama"), num_kv_blocks=64))
    assert isinstance(runner.forward, FusedLlama)
    assert not any(type(m) is nn.Linear for m in runner.model.modules())
    layer = runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and layer.self_attn.q_proj is None
    for off in ({"fused_layers": False}, {"packed_linear": False}):
        assert ModelRunner(EngineConfig(model=tiny_model("llama"), num_kv_blocks=64, **off)).forward.__class__ is not FusedLlama
    assert isinstance(ModelRunner(EngineConfig(model=tiny_model("qwen2"), num_kv_blocks=64)).forward, FusedLlama)


def test_fused_logits_match_transformers_on_a_packed_batch(tiny_model):
    """One step packing a prompt chunk beside a decode row: the fused forward's logits equal
    transformers' forward's (same engine, same weights, fused_layers off) to fp32 rounding."""
    from engine import LLMEngine, SamplingParams

    logits = {}
    for fused in (True, False):
        eng = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=64, fused_layers=fused, max_num_batched_tokens=64))
        assert isinstance(eng.runner.forward, FusedLlama) == fused
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        eng.add_request("a", list(range(100, 120)), params)
        eng.step()                                                  # a's prompt
        eng.add_request("b", list(range(300, 333)), params)        # b's prompt beside a's decode
        batch = eng.scheduler.schedule()
        logits[fused] = eng.runner.run(batch)
    assert logits[True].shape == logits[False].shape == (2, logits[True].shape[1])
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)


def test_serve_flags_reach_the_engine_config():
    """`--no-packed-linear` / `--no-fused-layers` turn the options off; by default both are auto."""
    import argparse

    from engine.config_cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    default = engine_config_from_args(p.parse_args([]))
    assert default.packed_linear is None and default.fused_layers is None
    off = engine_config_from_args(p.parse_args(["--no-packed-linear", "--no-fused-layers"]))
    assert off.packed_linear is False and off.fused_layers is False


def assert_rounded_like(got: torch.Tensor, want: torch.Tensor):
    """bf16 results of the C++ operators against transformers' bf16 modules: the same values,
    except where the two fp32 computations fall on either side of a bf16 rounding boundary
    (exp and the sums in another order): then one bf16 step apart, for at most 1 % of them."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    differ = got != want
    assert differ.float().mean().item() <= 0.01, f"{differ.sum().item()} of {got.numel()} differ"
    step = want.float().abs().clamp_min(1e-30) * 2.0 ** -7                # one bf16 step (8 significant bits)
    assert bool(((got.float() - want.float()).abs() <= step * 1.01)[differ].all())


def test_bf16_operators_round_where_transformers_does():
    """On bf16 tensors each operator equals transformers' bf16 module, rounding included: the
    residual sum, RMSNorm (normalized row, then times the weight), each rotary product and
    their sum, SiLU then the product. A missed rounding step shows up in far more than 1 % of
    the values."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    bf = torch.bfloat16
    torch.manual_seed(3)
    norm = LlamaRMSNorm(576, eps=1e-5).to(bf)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, residual = (torch.randn(7, 1152) * 3).to(bf)[:, :576], (torch.randn(7, 576) * 3).to(bf)
    with torch.inference_mode():
        assert_rounded_like(ops.rms_norm(x, norm.weight, 1e-5), norm(x))
        expected_residual = residual + x
        out = ops.add_rms_norm(x, residual, norm.weight, 1e-5)
        assert torch.equal(residual, expected_residual)
        assert_rounded_like(out, norm(expected_residual))
    n, h, hkv, d = 5, 9, 3, 64
    qkv = torch.randn(n, (h + 2 * hkv) * d).to(bf)
    q, k = qkv[:, :h * d].view(n, h, d), qkv[:, h * d:(h + hkv) * d].view(n, hkv, d)
    angles = torch.rand(n, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(bf), torch.cat([angles.sin()] * 2, -1).to(bf)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    ops.rotary(q, k, cos.float(), sin.float())
    assert_rounded_like(q, ref_q[0].transpose(0, 1))
    assert_rounded_like(k, ref_k[0].transpose(0, 1))
    gate_up = (torch.randn(3, 2 * 1536) * 4).to(bf)
    assert_rounded_like(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:])


@pytest.mark.skipif(linear_kind(torch.bfloat16) is None, reason="the fused forward does not run bf16 on this CPU")
def test_fused_bf16_logits_match_transformers_bf16(tiny_model):
    """In bf16 the runner fuses too (weights packed for the bf16 block kernel and oneDNN), and its logits on a packed
    batch meet the bf16 contract (tests/bf16.py): within twice what transformers' own bf16
    forward, run by the same engine on the same batch, is off the fp32 logits. The batch is
    the end of a chunked prompt (over its cached first chunk) beside a whole short prompt, so
    its rows depend on the prompts only, never on a token sampled in another dtype."""
    from engine import LLMEngine, SamplingParams

    logits = {}
    for dtype, fused in (("bfloat16", True), ("bfloat16", False), ("float32", False)):
        eng = LLMEngine(EngineConfig(model=tiny_model("llama"), dtype=dtype, num_kv_blocks=64,
                                     fused_layers=fused, max_num_batched_tokens=16, max_num_seqs=4))
        assert isinstance(eng.runner.forward, FusedLlama) == fused
        if fused:
            # the bf16 block kernel: every step where it is the VDPBF16PS form without AMX
            # (packed_linear.bf16_kernel_only) or widened (no bf16 dot products), else up to 4 rows (the head's 2 rows here) with
            # oneDNN's prepacked weight for the 12-row layers (the tiny model fits the budget)
            assert eng.runner.forward.lm_head.kind == "bf16"
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        eng.add_request("a", list(range(100, 120)), params)
        eng.step()
        eng.add_request("b", list(range(300, 308)), params)
        batch = eng.scheduler.schedule()
        assert batch.num_batched_tokens == 4 + 8, batch
        logits[dtype, fused] = eng.runner.run(batch).float()
    got, ref16, ref32 = logits["bfloat16", True], logits["bfloat16", False], logits["float32", False]
    assert got.shape == ref16.shape == ref32.shape
    assert_tensor_within_noise(got, ref32, ref16, what="fused bf16 logits")


def test_fused_forward_calls_the_kernel_directly_only_where_every_layer_is_plain(tiny_model, tmp_path, tokenizer_dir,
                                                                                 monkeypatch):
    """A plain Llama writes and attends with one kernel call each a layer (attention.kernel_layers),
    never through paged_attention; a model with windowed layers (Qwen3 with every layer sliding)
    keeps paged_attention for every layer. Both make the tokens of their unfused forward."""
    import engine.fused_llama as fused_llama
    from engine import LLMEngine, SamplingParams
    from tests.families import build_family_model

    calls = []
    wrapped = fused_llama.paged_attention
    monkeypatch.setattr(fused_llama, "paged_attention", lambda *a, **kw: calls.append(1) or wrapped(*a, **kw))
    sliding = build_family_model("qwen3-sliding", tmp_path / "qwen3-sliding", tokenizer_dir)
    for model, direct in ((tiny_model("llama"), True), (sliding, False)):
        tokens = {}
        for fused in (True, False):
            calls.clear()
            eng = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, fused_layers=fused, max_num_batched_tokens=16,
                                         max_num_seqs=4))
            assert isinstance(eng.runner.forward, FusedLlama) == fused
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            eng.add_request("a", list(range(100, 140)), params)      # chunked: 16-token steps, then decode
            eng.add_request("b", list(range(300, 305)), params)
            tokens[fused] = {}
            while eng.has_unfinished():
                for out in eng.step():
                    tokens[fused].setdefault(out.request_id, []).extend(out.new_token_ids)
            if fused:
                layers = len(eng.runner.forward.layers)
                assert (len(calls) == 0) if direct else (len(calls) >= layers), (model, len(calls))
        assert tokens[True] == tokens[False], model


@pytest.mark.parametrize("family, table", [("llama", True), ("llama-rope-llama3", True), ("qwen3-rope-yarn", True),
                                           ("llama-rope-dynamic", False)])
def test_rotary_rows_come_from_a_table_equal_to_the_module(family, table):
    """Where the rope type depends on the position alone the fused forward reads cos/sin rows
    from a table the model's rotary module computed once (grown past the largest position
    seen): the same values as the module's per step, for a batch's scattered positions, past
    the first 4,096 rows too. Dynamic scaling (which looks at the length) keeps the module."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.families import _BASE, FAMILIES

    model_type, extra = FAMILIES.get(family, ("llama", {}))
    if family == "llama-rope-dynamic":
        extra = dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=256, **{**_BASE, **extra})
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    fused = FusedLlama(model, "bf16")
    assert (fused.rope_table is not None) == table
    residual = torch.randn(4, config.hidden_size).to(torch.bfloat16)
    for positions in ([0, 17, 5, 4095], [4096, 9000, 3, 12]):
        pos = torch.tensor([positions])
        expected = [t[0].float() for t in model.model.rotary_emb(residual[None], pos)]
        got = fused._cos_sin(residual, pos)
        for g, e in zip(got, expected):
            assert g.dtype == torch.float32 and torch.equal(g, e)
    if table:
        assert fused.rope_table[0].shape[0] == 16384
