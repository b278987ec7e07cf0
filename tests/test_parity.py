"""Greedy parity with Hugging Face `generate` across batch compositions, chunked prefill
and prefix caching, on tiny Llama / Qwen2 / Qwen3 models and (slow) SmolLM2."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import NO_CUDA, cuda_available
from tests.bf16 import SKIP_REASON as BF16_SKIP
from tests.bf16 import assert_tokens_within_noise
from tests.bf16 import runs_here as bf16_runs_here
from tests.models import assert_greedy_parity, hf_greedy_batch, load_reference, pool, run_to_completion

FP32_TOL = 1e-4     # fp32: HF's greedy tokens exactly, up to near-ties of this size

# (device, dtype, attention backend[, engine options]): every attention path the engine can
# take. CPU fp32 runs the fused Llama forward (engine/fused_llama.py) on Llama models, and
# transformers' forward when fused_layers is off.
PATHS = [
    pytest.param(("cpu", "float32", "kernel"), id="cpu-fp32-kernel"),
    pytest.param(("cpu", "float32", "kernel", {"fused_layers": False}), id="cpu-fp32-kernel-hf-forward"),
    pytest.param(("cpu", "float32", "torch"), id="cpu-fp32-torch"),
    pytest.param(("cpu", "bfloat16", "kernel"), id="cpu-bf16-kernel"),
    pytest.param(("cuda", "bfloat16", "torch"), id="cuda-bf16",
                 marks=[pytest.mark.cuda, pytest.mark.skipif(not cuda_available(), reason=NO_CUDA)]),
]


def mixed_workload(n: int, lengths: list[int], max_new: int, seed: int = 0) -> dict[int, list[tuple]]:
    """n prompts of mixed lengths arriving at steps 0, 0, 1, 2, 3, ... (not all at once)."""
    rng = random.Random(seed)
    arrivals: dict[int, list[tuple]] = {}
    for i in range(n):
        prompt = [rng.randrange(100, 40_000) for _ in range(lengths[i % len(lengths)])]
        params = SamplingParams(max_tokens=max_new - (i % 3) * 3, temperature=0.0, ignore_eos=True)
        arrivals.setdefault(max(0, i - 1) * 2, []).append((f"r{i}", prompt, params))
    return arrivals


def check(engine_dir: str, path: tuple, arrivals, **cfg) -> LLMEngine:
    device, dtype, backend, *options = path
    engine = LLMEngine(EngineConfig(model=engine_dir, device=device, dtype=dtype, attention_backend=backend,
                                    **(options[0] if options else {}), **pool(cfg), **cfg))
    assert_parity(engine, engine_dir, device, dtype, arrivals)
    return engine


def assert_parity(engine: LLMEngine, model_dir: str, device: str, dtype: str, arrivals) -> None:
    """Runs `arrivals` on `engine` to the end: every output has full length and is correct
    for its dtype (fp32: HF's greedy tokens up to near-ties; bf16: the bf16 contract of
    tests/bf16.py, against fp32), and nothing is left running or holding blocks."""
    outputs = run_to_completion(engine, arrivals)
    for reqs in arrivals.values():
        for rid, prompt, params in reqs:
            assert len(outputs[rid]) == params.max_tokens
            assert_correct(model_dir, device, dtype, prompt, outputs[rid])
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0


def assert_correct(model_dir: str, device: str, dtype: str, prompt: list[int], got: list[int]) -> None:
    if dtype == "float32":
        assert_greedy_parity(load_reference(model_dir, device, dtype), prompt, got, FP32_TOL)
    else:
        assert_tokens_within_noise(model_dir, prompt, got, device)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_parity_chunked_mixed_batches(tiny_model, family, path):
    """10 prompts of 3..300 tokens arriving over several steps, a 48-token budget forcing
    chunked prefill beside decodes: every output equals HF greedy generate."""
    arrivals = mixed_workload(10, [3, 17, 300, 64, 1, 129, 33, 250, 16, 80], max_new=24)
    engine = check(tiny_model(family), path, arrivals, max_num_batched_tokens=48, max_num_seqs=8)
    assert engine.stats()["num_steps"] > 20


@pytest.mark.parametrize("path", PATHS)
def test_greedy_parity_under_kv_pressure(tiny_model, path):
    """A KV pool too small for all requests forces deferral and recompute preemption;
    outputs still equal HF and every block comes back."""
    arrivals = mixed_workload(8, [40, 70, 20, 90], max_new=40, seed=1)
    engine = check(tiny_model("llama"), path, arrivals, num_kv_blocks=20, block_size=8,
                   max_num_batched_tokens=64, max_num_seqs=8, watermark=0.0)
    assert engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("path", PATHS)
def test_prefix_cache_reuses_blocks_and_keeps_parity(tiny_model, path):
    """Requests sharing a long prefix reuse its blocks (hit tokens > 0) and still match HF."""
    rng = random.Random(7)
    shared = [rng.randrange(100, 40_000) for _ in range(100)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", shared + [11, 12, 13], params)],
                6: [("b", shared + [21, 22], params), ("c", shared[:64] + [5] * 20, params)],
                8: [("d", list(shared), params)]}
    engine = check(tiny_model("llama"), path, arrivals, max_num_batched_tokens=64)
    # b and d hit the 96 tokens of shared full blocks (6 blocks); c hits the first 4 blocks.
    assert engine.stats()["prefix_cache_hit_tokens"] >= 96 + 64 + 96


def test_prefix_cache_off_means_no_hits(tiny_model):
    """With prefix caching disabled the same requests produce no hits and the same outputs."""
    rng = random.Random(7)
    shared = [rng.randrange(100, 40_000) for _ in range(100)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", shared + [1], params)], 4: [("b", shared + [2], params)]}
    engine = check(tiny_model("llama"), ("cpu", "float32", "auto"), arrivals, enable_prefix_caching=False)
    assert engine.stats()["prefix_cache_hit_tokens"] == 0


# bf16 runs where tests/bf16.py's runs_here() says the references take seconds (not on
# AVX2-only CPUs). transformers' forward on CPU fp32 is checked on the tiny models only (the
# fused forward is SmolLM2's default and is checked on it).
SMOLLM2_PATHS = [p if p.id != "cpu-bf16-kernel" else pytest.param(
    *p.values, id=p.id, marks=pytest.mark.skipif(not bf16_runs_here(), reason=BF16_SKIP))
    for p in PATHS if p.id != "cpu-fp32-kernel-hf-forward"]


@pytest.mark.skipif(not bf16_runs_here(), reason=BF16_SKIP)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_bf16_head_dim_64_under_pressure_with_prefix_hits(tiny_model, mode):
    """The bf16 kernel paths at head_dim 64 (the 'llama-slow' model; the tiny models' head_dim
    16 keeps decode rows on the widening path): a pool small enough to preempt in `mode`,
    prompts sharing a prefix, chunked prefill beside decodes: every output meets the bf16
    contract (tests/bf16.py: each chosen token within the measured bf16 noise of the fp32
    maximum), and every block comes back. A wrong block or head order puts the chosen token
    several units below the maximum (tests/test_bf16_contract.py)."""
    rng = random.Random(5)
    shared = [rng.randrange(100, 40_000) for _ in range(48)]
    arrivals = mixed_workload(8, [40, 70, 20, 90], max_new=40, seed=2)
    for i, (step, reqs) in enumerate(list(arrivals.items())):       # every other step's prompts share a prefix
        arrivals[step] = [(rid, shared + prompt if i % 2 else prompt, params) for rid, prompt, params in reqs]
    engine = LLMEngine(EngineConfig(model=tiny_model("llama-slow"), dtype="bfloat16", attention_backend="kernel",
                                    num_kv_blocks=40, block_size=8, max_num_batched_tokens=64, max_num_seqs=8,
                                    watermark=0.0, preemption_mode=mode, num_swap_blocks=64, swap_min_tokens=60))
    outputs = run_to_completion(engine, arrivals)
    for reqs in arrivals.values():
        for rid, prompt, params in reqs:
            assert len(outputs[rid]) == params.max_tokens
            assert_tokens_within_noise(tiny_model("llama-slow"), prompt, outputs[rid])
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("path", SMOLLM2_PATHS)
def test_smollm2_greedy_parity(default_model_dir, path, all_threads):
    """SmolLM2-135M: 8 chat prompts of mixed lengths, chunked prefill, equal HF generate."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    questions = ["What is 2+2?", "Name three colors.", "Write a haiku about the sea.",
                 "Explain what a KV cache is. " * 8, "Hi", "List the planets of the solar system in order.",
                 "Translate 'good morning' into French and Spanish.", "Why is the sky blue? " * 20]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    arrivals: dict[int, list[tuple]] = {}
    for i, q in enumerate(questions):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"]) if isinstance(prompt, dict) or hasattr(prompt, "keys") else list(prompt)
        arrivals.setdefault(i // 2, []).append((f"q{i}", prompt, params))
    if path[1] == "float32":                        # the 8 HF references in one batched generate
        hf_greedy_batch(load_reference(default_model_dir, path[0], "float32"),
                        [p for reqs in arrivals.values() for _, p, _ in reqs], params.max_tokens)
    check(default_model_dir, path, arrivals, max_num_batched_tokens=96, max_num_seqs=8)


@pytest.mark.slow   # compiling takes minutes on two cores, even for a tiny model
@pytest.mark.parametrize("path", [p for p in PATHS if p.id in ("cpu-fp32-kernel", "cuda-bf16")])
def test_greedy_parity_compiled(tiny_model, path):
    """With torch.compile: chunked prefill beside decodes and recompute preemption still equal
    HF greedy; on the CPU (batches padded) the one graph compiled at start-up serves 20+ steps
    of changing batches (lone prompts, one or no sampled row) without recompiling."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    arrivals = mixed_workload(8, [40, 70, 20, 90, 3], max_new=16, seed=1)
    engine = check(tiny_model("llama"), path, arrivals, num_kv_blocks=20, block_size=8, max_num_batched_tokens=64,
                   max_num_seqs=8, watermark=0.0, compile=True)
    assert engine.stats()["num_preemptions"] > 0 and engine.stats()["num_steps"] > 20
    graphs = counters["stats"]["unique_graphs"] - before
    assert graphs == 1 if path[0] == "cpu" else graphs >= 1
