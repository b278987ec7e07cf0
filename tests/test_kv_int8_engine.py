"""An engine with `kv_cache_dtype="int8"` generates Hugging Face's greedy tokens for the same
model whose attention reads its keys and values rounded through the int8 rows (each (token,
head) row quantized with its own scale, csrc/kv_int8.h): on every CPU attention path (the
kernel under the fused forward and under transformers', the torch backend), across chunked
prefill beside decodes, prefix hits, and preemption by recompute and by swap. fp32, so
"equal" means equal up to near-ties, as in tests/test_parity.py."""

from __future__ import annotations

import random
from functools import lru_cache

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.engine.kv_int8 import register_int8_kv_attention
from engine import EngineConfig, LLMEngine, SamplingParams
from tests.models import assert_greedy_parity, run_to_completion
from tests.test_families import family_model  # noqa: F401 (fixture)
from tests.test_parity import FP32_TOL, mixed_workload


@lru_cache(maxsize=4)
def int8_kv_reference(model_dir: str):
    """HF's model whose attention reads its keys and values rounded through int8 rows (per token
    and head, as the engine stores them: bench.engine.kv_int8.register_int8_kv_attention)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=register_int8_kv_attention(),
                                                 dtype=torch.float32).eval()
    model.name_or_path = f"{model_dir}#int8-kv"      # its own entry in tests/models.py's greedy cache
    return model


PATHS = [pytest.param(("kernel", {}), id="kernel-fused"),
         pytest.param(("kernel", {"fused_layers": False}), id="kernel-hf-forward"),
         pytest.param(("torch", {}), id="torch")]


def run(model_dir: str, path, arrivals, **cfg) -> LLMEngine:
    backend, options = path
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", attention_backend=backend,
                                    kv_cache_dtype="int8", **options, **cfg))
    cache = engine.runner.kv_cache
    assert cache.quantized and cache.k.dtype == torch.int8
    assert engine.runner.use_kernel == (backend == "kernel") and engine.runner.use_torch == (backend == "torch")
    outputs = run_to_completion(engine, arrivals)
    ref = int8_kv_reference(model_dir)
    for reqs in arrivals.values():
        for rid, prompt, params in reqs:
            assert len(outputs[rid]) == params.max_tokens
            assert_greedy_parity(ref, prompt, outputs[rid], FP32_TOL)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    return engine


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_kv_greedy_parity_chunked_mixed_batches(tiny_model, family, path):
    """10 prompts of 1..300 tokens arriving over several steps, a 48-token budget: chunks over
    their own earlier int8 rows beside decode rows."""
    arrivals = mixed_workload(10, [3, 17, 300, 64, 1, 129, 33, 250, 16, 80], max_new=24)
    run(tiny_model(family), path, arrivals, max_num_batched_tokens=48, max_num_seqs=8, kv_cache_memory_gb=1 / 16)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_int8_kv_parity_under_pressure_with_prefix_hits(tiny_model, mode, path):
    """A pool small enough to preempt in `mode` (a swap moves each row's scale with its values),
    prompts sharing a prefix (their int8 blocks shared): parity, and every block comes back."""
    rng = random.Random(5)
    shared = [rng.randrange(100, 40_000) for _ in range(48)]
    arrivals = mixed_workload(8, [40, 70, 20, 90], max_new=40, seed=2)
    for i, (step, reqs) in enumerate(list(arrivals.items())):
        arrivals[step] = [(rid, shared + prompt if i % 2 else prompt, params) for rid, prompt, params in reqs]
    engine = run(tiny_model("llama"), path, arrivals, num_kv_blocks=40, block_size=8, max_num_batched_tokens=64,
                 max_num_seqs=8, watermark=0.0, preemption_mode=mode, num_swap_blocks=64, swap_min_tokens=60)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats


def test_int8_kv_holds_more_tokens_per_gib(tiny_model):
    """Sized from kv_cache_memory_gb, an int8 pool has (element size x D) / (D + 4) times the
    blocks of the model dtype's: 1.88x bf16's at SmolLM2's head_dim 64; here fp32 at the tiny
    model's head_dim 16, 3.2x."""
    sizes = {}
    for kv in (None, "int8"):
        engine = LLMEngine(EngineConfig(model=tiny_model("llama"), kv_cache_memory_gb=1 / 64, kv_cache_dtype=kv))
        sizes[kv] = engine.runner.num_blocks
    assert abs(sizes["int8"] / sizes[None] - 4 * 16 / 20) < 0.01, sizes


@pytest.mark.parametrize("bad, match", [
    (dict(kv_cache_dtype="fp8"), "EngineConfig.kv_cache_dtype: must be one of"),
    (dict(kv_cache_dtype="int8", compile=True), "EngineConfig.kv_cache_dtype: int8 runs on CPU"),
    (dict(kv_cache_dtype="int8", device="cuda"), "EngineConfig.kv_cache_dtype: int8 runs on CPU"),
])
def test_kv_cache_dtype_is_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_kv_cache_dtype_flag_reaches_the_engine_config():
    import argparse

    from engine.config_cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    assert engine_config_from_args(parser.parse_args([])).kv_cache_dtype is None


def test_int8_kv_on_two_tensor_parallel_ranks_equals_one_process(tiny_model):
    """Each rank quantizes its own KV heads' rows: 2 ranks under chunked prefill, prefix hits
    and both preemptions give exactly the one-process int8-KV engine's tokens (fp32)."""
    from tests.test_tp import PRESSURE, workload

    common = dict(model=tiny_model("llama"), kv_cache_dtype="int8", attention_backend="kernel", **PRESSURE)
    tp = LLMEngine(EngineConfig(tensor_parallel_size=2, tp_timeout_s=60.0, **common))
    try:
        got = run_to_completion(tp, workload())
        stats = tp.stats()
        assert stats["preemptions_recompute"] > 0 and stats["preemptions_swap"] > 0, stats
        assert tp.runner.kv_cache.k.dtype == torch.int8
    finally:
        tp.close()
    assert got == run_to_completion(LLMEngine(EngineConfig(**common)), workload())


@pytest.mark.parametrize("path", PATHS[:2])
def test_int8_kv_with_speculation_keeps_the_output(repeat_model, path):
    """n-gram drafts verified over int8 rows (multi-row items, rejected rows rewritten later):
    the same tokens as the int8-KV engine without speculation and as the int8-rounded HF
    reference, with drafts accepted."""
    from tests.speculative_util import prompts, staggered

    backend, options = path
    ps = prompts(6)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cfg = dict(model=repeat_model, kv_cache_dtype="int8", attention_backend=backend, max_num_batched_tokens=32,
               max_num_seqs=6, block_size=8, num_kv_blocks=200, speculative_ngram_min=1, **options)
    want = run_to_completion(LLMEngine(EngineConfig(**cfg)), staggered(ps, params))
    spec = LLMEngine(EngineConfig(num_speculative_tokens=4, **cfg))
    assert run_to_completion(spec, staggered(ps, params)) == want
    assert spec.stats()["spec_accepted_tokens"] > 50
    ref = int8_kv_reference(repeat_model)
    for i, p in enumerate(ps):
        assert_greedy_parity(ref, p, want[f"r{i}"], FP32_TOL)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss", "qwen3-sliding"])
def test_int8_kv_families_with_windows_softcaps_and_sinks(family_model, family):
    """Sliding windows (a hybrid model's own KV-cache groups), soft-capping and sinks over int8
    rows: the kernel gives the torch backend's tokens (both read the same dequantized values,
    fp32), under chunking and prefix hits, and every block comes back."""
    from tests.test_families import workload

    outs = {}
    for backend in ("kernel", "torch"):
        engine = LLMEngine(EngineConfig(model=family_model(family), kv_cache_dtype="int8", attention_backend=backend,
                                        block_size=8, max_num_batched_tokens=32, max_num_seqs=8,
                                        kv_cache_memory_gb=1 / 64))
        assert engine.runner.kv_cache.k.dtype == torch.int8
        outs[backend] = run_to_completion(engine, workload())
        stats = engine.stats()
        assert stats["kv_blocks_used"] == 0 and stats["prefix_cache_hit_tokens"] > 0
    assert outs["kernel"] == outs["torch"]
