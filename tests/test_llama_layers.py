"""The fused forward's layers as one operator call (csrc/llama_layers.cpp) against its Python
loop: the same logits, bit for bit, on a batch of a chunk over cached context beside a whole
prompt and decode rows, for Llama and Qwen2 (q/k/v biases), bf16 and int8 weights (and the
int8 KV cache); the same
greedy tokens; and the call really taken where the forward says it can run. bf16 runs on the
elastic pool, so that its linears run on the block kernel alone (the operator's condition) on
any avx512_bf16 build."""

from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.dtypes import cpu_flags
from engine.fused_llama import FusedLlama, linear_kind
from engine.kernels import load_kernels, loaded_variant
from engine.packed_linear import bf16_widened

pytestmark = pytest.mark.skipif(not load_kernels(), reason="the C++ kernels did not build (see the log)")

# bf16 runs the one call only where no linear keeps oneDNN's copy: the avx512_bf16 build, without
# AMX or with the elastic pool's helpers (packed_linear.bf16_kernel_only; the pool needs a second
# thread), or a CPU without bf16 dot products (packed_linear.bf16_widened: the shift+FMA kernel).
BF16_ON_KERNELS = load_kernels() and (
    (bf16_widened() and linear_kind(torch.bfloat16) is not None)        # the fused forward runs bf16 there
    or loaded_variant() == "avx512_bf16" and ("amx_bf16" not in cpu_flags() or torch.get_num_threads() > 1))
bf16_only_on_kernels = pytest.mark.skipif(
    not BF16_ON_KERNELS, reason="bf16 linears leave steps to oneDNN here (AMX on one thread): the layers cannot be "
                                "one call")


def engine_for(model: str, quantization: str | None) -> LLMEngine:
    """bf16 on the elastic pool (its linears then on the block kernel alone on any avx512_bf16
    build), or int8 weights (their kernel takes steps of up to 32 rows), "int8+kv8" with the int8
    KV cache too."""
    weights = quantization.split("+")[0] if quantization else None
    eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=16,
                                 max_num_seqs=4, elastic_threads=True if quantization is None else None,
                                 quantization=weights, enable_prefix_caching=False,
                                 kv_cache_dtype="int8" if quantization == "int8+kv8" else None))
    forward = eng.runner.forward
    assert isinstance(forward, FusedLlama) and forward.layer_args is not None, "the one-call forward is off"
    return eng


CASES = [pytest.param("llama", None, marks=bf16_only_on_kernels), pytest.param("qwen2", None, marks=bf16_only_on_kernels),
         ("llama", "int8"), ("qwen2", "int8"), ("llama", "int8+kv8")]


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of torch.ops.streamgate.llama_layers (the forward looks it up each step)."""
    calls = []
    real = torch.ops.streamgate.llama_layers
    monkeypatch.setattr(torch.ops.streamgate, "llama_layers", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("family, quantization", CASES)
def test_one_call_gives_the_python_loops_logits_bit_for_bit(tiny_model, family, quantization, counted):
    """Every step of a chunked prompt beside a short one, then their decode rows, runs both ways
    (the second run writes the same K/V into the same slots); the logits must be equal."""
    eng = engine_for(tiny_model(family), quantization)
    forward, real_run = eng.runner.forward, eng.runner.run
    steps = []

    def both(batch, *args, **kwargs):
        forward.cpp_layers = False
        ref = real_run(batch, *args, **kwargs)
        before = len(counted)
        forward.cpp_layers = True
        got = real_run(batch, *args, **kwargs)
        assert len(counted) == before + 1
        assert got.dtype == ref.dtype and torch.equal(got, ref), batch
        steps.append((batch.num_prefill_tokens, batch.num_decode_tokens))
        return got

    eng.runner.run = both
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(100, 130)), params)          # 16-token chunks, then decode
    eng.add_request("b", list(range(300, 305)), params)
    while eng.has_unfinished():
        eng.step()
    assert any(p and d for p, d in steps) or any(p > 0 for p, _ in steps[1:]), steps   # a chunk over context
    assert any(p == 0 and d == 2 for p, d in steps), steps                            # two decode rows


@pytest.mark.parametrize("family, quantization", CASES)
def test_greedy_tokens_are_the_python_loops(tiny_model, family, quantization, counted):
    tokens = {}
    for on in (True, False):
        eng = engine_for(tiny_model(family), quantization)
        eng.runner.forward.cpp_layers = on
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        eng.add_request("a", list(range(100, 140)), params)
        eng.add_request("b", list(range(300, 305)), params)
        tokens[on] = {}
        while eng.has_unfinished():
            for out in eng.step():
                tokens[on].setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens[True] == tokens[False]
    assert all(len(t) == 6 for t in tokens[True].values())
    assert counted, "the one-call forward never ran"


def test_the_bound_layers_follow_the_cache_they_attend_over(tiny_model):
    """The weights and pools are bound once (LlamaLayers); a step over another cache's pools
    (row_pools made again: a new list) binds again, and the tokens stay the Python loop's."""
    tokens = {}
    for on in (True, False):
        eng = engine_for(tiny_model("llama"), "int8")
        forward, cache = eng.runner.forward, eng.runner.kv_cache
        forward.cpp_layers = on
        eng.add_request("a", list(range(100, 140)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        out, bound = [], []
        while eng.has_unfinished():
            for o in eng.step():
                out.extend(o.new_token_ids)
            bound.append(forward._bound[1] if forward._bound else None)
            cache._row_pools = [(k.view(k.shape), v.view(v.shape)) for k, v in cache.row_pools()]   # other tensors
        tokens[on] = out
        if on:
            assert all(b is not None for b in bound) and len({id(b) for b in bound}) == len(bound)
    assert tokens[True] == tokens[False] and len(tokens[True]) == 6
