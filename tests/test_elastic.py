"""The kernels' elastic pool (csrc/parallel.h, engine/elastic.py): the same bits as OpenMP's
loops whoever runs the chunks, a loop that finishes when no helper ever runs, and an engine
on it that keeps the bf16 contract, or says why it cannot use it."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, elastic
from engine.kernels import load_kernels, loaded_variant
from engine.packed_linear import bf16_widened
from tests.bf16 import assert_tokens_within_noise
from tests.models import run_to_completion

pytestmark = [
    pytest.mark.skipif(not load_kernels(), reason="the C++ kernels did not build: no elastic pool"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: no helper thread to share loops with"),
]
# Why an engine in bf16 cannot take the pool on this host (None: it can).
BF16_UNFIT = elastic.fits(torch.bfloat16) if load_kernels() else "the C++ kernels did not build"


@pytest.fixture
def pool_off_after():
    yield
    torch.ops.streamgate.elastic_hold(False)
    torch.ops.streamgate.elastic_threads(0)


def mixed_batch(eng: LLMEngine):
    """A step with decode rows of three sequences and a 90-token prefill chunk of a fourth."""
    rng = random.Random(3)
    for i, n in enumerate((40, 70, 20)):
        eng.add_request(f"d{i}", [rng.randrange(100, 30_000) for _ in range(n)], SamplingParams(max_tokens=8))
    eng.step()
    eng.add_request("p", [rng.randrange(100, 30_000) for _ in range(90)], SamplingParams(max_tokens=8))
    batch = eng.scheduler.schedule()
    assert batch.num_batched_tokens == 93
    return batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loops_on_the_pool_give_openmps_bits_even_when_no_helper_runs(tiny_model, dtype, pool_off_after):
    """One mixed step (prefill chunk + decode rows) through every kernel (linears, attention,
    norms, rotary, SiLU) on OpenMP's loops, on the pool with 2 and 3 threads, and on the pool
    with its helpers held (they claim nothing, as if the OS never ran them): the logits are
    equal bit for bit, since chunks split outputs, never a sum, and the held run finishes, the
    caller running every chunk (it never waits for a helper that has not started one)."""
    eng = LLMEngine(EngineConfig(model=tiny_model("llama-slow"), dtype=dtype, attention_backend="kernel",
                                 num_kv_blocks=64, block_size=8, adaptive_threads=False))
    batch = mixed_batch(eng)
    prepared = eng.runner._prepare(batch)
    full = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref = eng.runner.execute(*prepared).clone()
        for threads in (2, 3):
            assert torch.ops.streamgate.elastic_threads(threads) == threads
            assert torch.equal(eng.runner.execute(*prepared), ref), threads
        torch.ops.streamgate.elastic_hold(True)
        done, out = threading.Event(), {}

        def held():
            out["logits"] = eng.runner.execute(*prepared).clone()
            done.set()

        threading.Thread(target=held, daemon=True).start()
        assert done.wait(120), "a loop waited for a helper that never ran"
        assert torch.equal(out["logits"], ref)
        assert torch.ops.streamgate.elastic_threads(0) == 0
        # Back on OpenMP's loops, as many threads: the same bits.
        assert torch.equal(eng.runner.execute(*prepared), ref)
    finally:
        torch.set_num_threads(full)


@pytest.mark.skipif(BF16_UNFIT is not None, reason=f"bf16 engines cannot take the pool here: {BF16_UNFIT}")
def test_elastic_engine_keeps_the_bf16_contract(tiny_model, all_threads, pool_off_after):
    """EngineConfig(elastic_threads=True) in bf16 where the avx512_bf16 kernels are built: the
    pool runs with as many threads as torch had, the thread tuner is off, steps run torch's
    operators on one thread, and chunked prefill beside decodes meets the bf16 contract
    (tests/bf16.py)."""
    eng = LLMEngine(EngineConfig(model=tiny_model("llama-slow"), dtype="bfloat16", attention_backend="kernel",
                                 num_kv_blocks=64, block_size=8, max_num_batched_tokens=64, elastic_threads=True))
    assert eng.runner.elastic and elastic.pool_threads() == os.cpu_count() and eng.runner.threads is None
    rng = random.Random(7)
    arrivals = {s: [(f"r{s}", [rng.randrange(100, 30_000) for _ in range(n)],
                     SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))]
                for s, n in ((0, 100), (1, 30), (3, 150))}
    outputs = run_to_completion(eng, arrivals)
    assert torch.get_num_threads() == 1                               # the stepping thread's torch operators
    for reqs in arrivals.values():
        for rid, prompt, params in reqs:
            assert len(outputs[rid]) == params.max_tokens
            assert_tokens_within_noise(tiny_model("llama-slow"), prompt, outputs[rid])


def test_elastic_threads_are_refused_where_big_steps_leave_the_kernels(tiny_model, all_threads, pool_off_after):
    """fp32 steps above a few rows run MKL or oneDNN, which one torch thread would slow: the
    engine keeps OpenMP and the pool stays off."""
    eng = LLMEngine(EngineConfig(model=tiny_model("llama"), dtype="float32", num_kv_blocks=32, elastic_threads=True))
    assert not eng.runner.elastic and elastic.pool_threads() == 0
    assert "float32" in elastic.fits(torch.float32)


def test_served_engines_take_the_pool_by_default_in_process_ones_do_not(tiny_model, all_threads, pool_off_after):
    """elastic_threads None (the default): the engine AsyncEngine builds runs on the pool where
    it fits; an LLMEngine made in process keeps OpenMP; False keeps OpenMP when served too."""
    from engine.async_engine import _build_engine

    cfg = dict(model=tiny_model("llama-slow"), dtype="bfloat16", num_kv_blocks=32, block_size=8)
    assert not LLMEngine(EngineConfig(**cfg)).runner.elastic and elastic.pool_threads() == 0
    assert not _build_engine(EngineConfig(elastic_threads=False, **cfg)).runner.elastic
    assert elastic.pool_threads() == 0
    served = _build_engine(EngineConfig(**cfg))
    assert served.runner.elastic == (BF16_UNFIT is None)
    assert elastic.pool_threads() == (os.cpu_count() if served.runner.elastic else 0)


@pytest.mark.skipif(BF16_UNFIT is not None, reason=f"bf16 engines cannot take the pool here: {BF16_UNFIT}")
def test_int8_engines_take_the_pool_and_their_prefill_steps_keep_openmps_bits(tiny_model, all_threads, pool_off_after):
    """int8 weights in bf16 take the pool wherever bf16 does (without AMX their prefill steps
    dequantize into the block kernel's layout, quantization.py, or without bf16 dot products
    into fp32 for MKL's GEMM): a mixed step of 93 rows (past the int8 kernel's 32) gives the
    same logits on the pool as on OpenMP's loops."""
    eng = LLMEngine(EngineConfig(model=tiny_model("llama-slow"), dtype="bfloat16", quantization="int8",
                                 attention_backend="kernel", num_kv_blocks=64, block_size=8, elastic_threads=True))
    assert eng.runner.elastic and elastic.fits(torch.bfloat16) is None
    prepared = eng.runner._prepare(mixed_batch(eng))
    on_pool = eng.runner.execute(*prepared).clone()
    assert torch.ops.streamgate.elastic_threads(0) == 0
    # OpenMP's loops on as many threads as the pool had: the runner then keeps torch's count (on
    # the pool it takes one, but a CPU without bf16 dot products runs these 93 rows' GEMMs on
    # MKL with the pool's count, elastic.library_gemm, and MKL's bits follow the count).
    eng.runner.elastic = False
    torch.set_num_threads(os.cpu_count())
    assert torch.equal(eng.runner.execute(*prepared), on_pool)


@pytest.mark.skipif(BF16_UNFIT is not None, reason=f"bf16 engines cannot take the pool here: {BF16_UNFIT}")
def test_a_library_gemm_on_the_pool_gets_torchs_threads_back(tiny_model, all_threads, pool_off_after):
    """On the pool a step's torch operators run on one thread, but a GEMM the kernels leave to
    MKL (int8's dequantized big steps on a CPU without bf16 dot products)
    runs inside library_gemm on the threads torch had when the pool started, then one again;
    with the pool off it leaves torch's count alone."""
    eng = LLMEngine(EngineConfig(model=tiny_model("llama-slow"), dtype="bfloat16", num_kv_blocks=16,
                                 elastic_threads=True))
    full = os.cpu_count()
    assert eng.runner.elastic and elastic.pool_threads() == full
    elastic.one_torch_thread()
    with elastic.library_gemm():
        assert torch.get_num_threads() == full
    assert torch.get_num_threads() == 1
    assert torch.ops.streamgate.elastic_threads(0) == 0
    with elastic.library_gemm():
        assert torch.get_num_threads() == 1


@pytest.mark.skipif(not bf16_widened() or loaded_variant() == "avx512_bf16",
                    reason="a CPU with bf16 dot products: the avx512_bf16 build runs every bf16 step on the kernels")
def test_without_bf16_dot_products_only_the_fused_forward_takes_the_pool(tiny_model, all_threads, pool_off_after):
    """Without bf16 dot products the kernels run bf16 steps for the fused forward only:
    transformers' forward (`fused_layers=False`, or a family it does not fuse) would run torch's
    emulated bf16 matmuls on the pool's one torch thread, so such an engine stays on OpenMP."""
    assert elastic.fits(torch.bfloat16) is None
    assert "fused forward" in elastic.fits(torch.bfloat16, fused=False)
    model = tiny_model("llama")
    fused = LLMEngine(EngineConfig(model=model, dtype="bfloat16", num_kv_blocks=16, elastic_threads=True))
    assert fused.runner.elastic
    torch.ops.streamgate.elastic_threads(0)
    plain = LLMEngine(EngineConfig(model=model, dtype="bfloat16", num_kv_blocks=16, elastic_threads=True,
                                   fused_layers=False))
    assert not plain.runner.elastic and elastic.pool_threads() == 0
