"""The speed options: dtype "auto", the attention backend choice and their validation."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine import dtypes
from engine.kernels import paged_attention_ops


@pytest.mark.parametrize("flags, want", [({"avx2", "fma"}, torch.float32),
                                         ({"avx2", "fma", "avx512f", "avx512bw"}, torch.float32),
                                         ({"avx512f", "avx512_bf16"}, torch.bfloat16),
                                         ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16)])
def test_auto_dtype_is_bf16_only_with_native_bf16(monkeypatch, flags, want):
    """On CPU "auto" picks bf16 where the CPU has bf16 dot products (AVX512-BF16 or AMX-bf16),
    unless the caller says the fused forward runs bf16 without them (below); explicit dtypes
    are kept."""
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(flags))
    assert dtypes.resolve_dtype("auto", torch.device("cpu")) == want
    assert dtypes.resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert dtypes.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_auto_is_bf16_without_bf16_dot_products_only_where_the_fused_forward_runs_it(monkeypatch):
    """Without bf16 dot products, "auto" is bf16 only where the fused forward runs the model in
    bf16 (its block kernel, big steps widened to fp32 GEMMs): not for a family it does not run
    (transformers' forward would emulate bf16 matmuls), under torch.compile, tensor parallelism,
    or with the fused layers or packed linears off; nor where the widened form does not apply."""
    from types import SimpleNamespace

    from transformers import Gemma2Config, LlamaConfig

    from engine import fused_llama

    monkeypatch.setattr(fused_llama, "linear_kind", lambda dtype: "onednn")
    monkeypatch.setattr(fused_llama, "available", lambda: "streamgate")
    monkeypatch.setattr(fused_llama, "bf16_widened", lambda: True)
    base = dict(device="cpu", fused_layers=None, packed_linear=None, compile=False, tensor_parallel_size=1)
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert fused_llama.bf16_widened_here(SimpleNamespace(**base), llama)
    assert not fused_llama.bf16_widened_here(SimpleNamespace(**base), Gemma2Config(hidden_size=64, num_hidden_layers=2))
    for field, value in [("compile", True), ("tensor_parallel_size", 2), ("fused_layers", False),
                         ("packed_linear", False), ("device", "cuda")]:
        assert not fused_llama.bf16_widened_here(SimpleNamespace(**{**base, field: value}), llama), field
    assert not fused_llama.bf16_widened_here(SimpleNamespace(**base), LlamaConfig(hidden_act="gelu"))
    monkeypatch.setattr(fused_llama, "bf16_widened", lambda: False)
    assert not fused_llama.bf16_widened_here(SimpleNamespace(**base), llama)
    assert dtypes.resolve_dtype("auto", torch.device("cpu"), widened_bf16=True) == torch.bfloat16
    assert dtypes.resolve_dtype("float32", torch.device("cpu"), widened_bf16=True) == torch.float32


def test_auto_dtype_engine_runs_in_the_resolved_dtype(tiny_model):
    """An engine with dtype "auto" holds its weights and KV pool in the resolved dtype: bf16
    with bf16 dot products, or without them where the fused forward runs it (the tiny Llama
    here: packed_linear.bf16_widened on an AVX-512 CPU), else fp32."""
    from engine import fused_llama, packed_linear

    engine = LLMEngine(EngineConfig(model=tiny_model("llama"), dtype="auto", num_kv_blocks=16))
    widened = packed_linear.bf16_widened() and fused_llama.linear_kind(torch.bfloat16) is not None
    want = torch.bfloat16 if dtypes.native_bf16_cpu() or widened else torch.float32
    assert engine.runner.kv_cache.k.dtype == want
    assert next(engine.runner.model.parameters()).dtype == want
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert sum(len(o.new_token_ids) for o in outs) == 3


@pytest.mark.parametrize("field, value", [("attention_backend", "flash"), ("dtype", "fp8")])
def test_bad_speed_options_name_the_field(field, value):
    """An unknown backend or dtype is refused with the field's name."""
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**{field: value})


def test_kernel_backend_is_cpu_only():
    """Asking for the CPU kernel on CUDA is refused at construction, naming the field."""
    with pytest.raises(ValueError, match="EngineConfig.attention_backend"):
        EngineConfig(device="cuda", attention_backend="kernel")


def test_auto_backend_takes_the_kernel_where_it_builds(tiny_model):
    """On CPU, "auto" runs the C++ kernel when it is built and "torch" never does."""
    auto = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=8))
    torch_path = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=8, attention_backend="torch"))
    assert auto.runner.use_kernel == (paged_attention_ops() is not None)
    assert not torch_path.runner.use_kernel


@pytest.mark.skipif(paged_attention_ops() is None, reason="the paged attention kernel did not build (see the log)")
def test_eager_kernel_takes_every_row_decode_and_chunk(tiny_model):
    """Eager, the kernel attends for every sequence, a 1-token tail and a 40-token chunk alike,
    in one call: no row is left to the gather + SDPA groups."""
    engine = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=32, max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("long", list(range(5, 45)), params)
    engine.add_request("short", [5], params)
    batch = engine.scheduler.schedule()
    assert sorted(batch.num_new_tokens) == [1, 40]
    _, _, _, meta = engine.runner._prepare(batch)
    n = batch.num_new_tokens
    assert meta.kernel.q_start.tolist() == [0, n[0], n[0] + n[1]]
    assert meta.kernel.ctx_lens.tolist() == n
    assert meta.prefills == [] and meta.decodes == []
