"""Adaptive threads for small steps (engine/threads.py): the tuner's choices on a fake clock,
and on the real engine that the choice never changes an output."""

from __future__ import annotations

import os

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.threads import ThreadTuner
from tests.models import TEST_POOL

ONE_CPU = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: one thread is all there is, nothing to choose "
                             "or compare, and no OpenMP workers")


def test_tuner_measures_both_then_runs_the_faster_and_keeps_probing():
    """Small steps: all threads then one thread until each has `probe` samples, then the one
    with the lower median, except `probe` steps of the other every `explore_every`; per row
    count; larger steps always take all threads."""
    tuner = ThreadTuner(full=2, max_rows=4, explore_every=10, probe=2, window=4)
    cost = {2: 0.010, 1: 0.007}                                       # one thread is faster (a busy host)
    picks = []
    for _ in range(30):
        t = tuner.choose(1)
        tuner.record(1, t, cost[t])
        picks.append(t)
    assert picks[:4] == [2, 2, 1, 1]                                  # both measured first
    later = picks[4:]
    assert later.count(1) > later.count(2) > 0                        # mostly the faster, still probing
    assert tuner.preferred(1) == 1
    assert tuner.choose(5) == 2 and tuner.preferred(3) is None        # big step; 3 rows not measured
    cost = {2: 0.004, 1: 0.007}                                       # the host went quiet
    for _ in range(40):
        t = tuner.choose(1)
        tuner.record(1, t, cost[t])
    assert tuner.preferred(1) == 2 and tuner.choose(1) in (1, 2)
    assert [ThreadTuner(full=1).choose(1) for _ in range(3)] == [1, 1, 1]


def test_large_steps_are_tuned_by_bucket_where_asked():
    """With `large`, steps over max_rows are measured too, per power-of-two bucket and by time
    per row (a 300- and a 500-row step share the 512 bucket), exploring every `large_every`
    steps; without it they always take all threads."""
    tuner = ThreadTuner(full=2, max_rows=4, probe=2, window=4, large=True, large_every=20)
    cost = {2: 0.004, 1: 0.003}                                       # per row: one thread faster (a busy host)
    picks = []
    for i in range(40):
        rows = 300 if i % 2 else 500
        t = tuner.choose(rows)
        tuner.record(rows, t, cost[t] * rows)
        picks.append(t)
    assert picks[:4] == [2, 2, 1, 1] and tuner.preferred(400) == 1 and tuner.key(300) == tuner.key(512) == 512
    assert 0 < picks[4:].count(2) < picks[4:].count(1)                 # still probing, mostly the faster
    assert tuner.preferred(40) is None and tuner.choose(1) == 2         # other buckets measured apart
    assert ThreadTuner(full=2).choose(500) == 2 and ThreadTuner(full=2).key(500) is None


@ONE_CPU
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_steps_are_bit_identical_on_one_or_all_threads_where_tuned(default_model_dir, dtype, all_threads):
    """Off by default; asked for (adaptive_threads_all_steps), the tuner takes steps of every
    size only on the fused forward on the fp32 kernel or on the bf16 block kernel alone, and
    there a 330-row prefill step gives the same logits on one thread and on all."""
    from engine.packed_linear import bf16_kernel_only

    assert not LLMEngine(EngineConfig(model=default_model_dir, dtype=dtype, **TEST_POOL)).runner.threads.large
    eng = LLMEngine(EngineConfig(model=default_model_dir, dtype=dtype, adaptive_threads_all_steps=True, **TEST_POOL))
    assert eng.runner.threads.large == (dtype == "float32" or bf16_kernel_only())
    if not eng.runner.threads.large:               # big bf16 steps run oneDNN here: always all threads
        return
    for i, n in enumerate((40, 90, 200)):
        eng.add_request(f"r{i}", list(range(100 + i, 100 + i + n)), SamplingParams(max_tokens=8, temperature=0.0))
    batch = eng.scheduler.schedule()
    assert batch.num_batched_tokens == 330
    full, logits = torch.get_num_threads(), {}
    eng.runner.threads = None                      # the thread count set here, not the tuner's
    try:
        for threads in (full, 1):
            torch.set_num_threads(threads)
            logits[threads] = eng.runner.execute(*eng.runner._prepare(batch)).clone()
    finally:
        torch.set_num_threads(full)
    assert torch.equal(logits[full], logits[1])


@ONE_CPU
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 on this CPU (no AVX512-BF16 or AMX)"))])
def test_small_steps_are_bit_identical_on_one_or_all_threads(default_model_dir, dtype, all_threads):
    """A decode step of 1-3 rows gives the same logits, bit for bit, on one thread and on all:
    the kernels split work by output rows and sequences, never a sum, so the tuner's choice
    (which depends on timing) cannot change what is generated."""
    full = torch.get_num_threads()
    for rows in (3, 1):
        eng = LLMEngine(EngineConfig(model=default_model_dir, dtype=dtype, adaptive_threads=False, **TEST_POOL))
        for i, n in enumerate((40, 90, 200)[:rows]):
            eng.add_request(f"r{i}", list(range(100 + i, 100 + i + n)), SamplingParams(max_tokens=8, temperature=0.0))
        eng.step()                                                     # the prompts
        batch = eng.scheduler.schedule()                               # one decode row each
        assert batch.num_batched_tokens == rows
        logits = {}
        try:
            for threads in (full, 1):
                torch.set_num_threads(threads)
                logits[threads] = eng.runner.run(batch).clone()
        finally:
            torch.set_num_threads(full)
        assert full > 1 and torch.equal(logits[full], logits[1])


def test_engine_with_adaptive_threads_measures_both_and_matches(tiny_model, all_threads):
    """With adaptive threads (the default) small steps are measured on both choices and the
    greedy outputs equal an engine's with the option off."""
    outs = {}
    for adaptive in (True, False):
        eng = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=64, adaptive_threads=adaptive))
        eng.add_request("a", list(range(100, 130)), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        tokens = []
        while eng.has_unfinished():
            tokens += [t for o in eng.step() for t in o.new_token_ids]
        outs[adaptive] = tokens
        tuner = eng.runner.threads
        if adaptive and torch.get_num_threads() > 1:
            assert tuner is not None and tuner.preferred(1) in (1, torch.get_num_threads())
            assert torch.get_num_threads() == tuner.full                # never left on one thread
        if not adaptive:
            assert tuner is None
    assert outs[True] == outs[False] and len(outs[True]) == 24


@ONE_CPU
def test_release_openmp_pool_ends_the_calling_threads_workers():
    """After a parallel region, the calling thread's OpenMP workers are threads of the process;
    release_openmp_pool() ends them (so the engine thread's team is the only one libgomp
    manages) and later torch ops still run, on a new pool, with the same results."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, time, torch
        from engine.threads import release_openmp_pool
        torch.set_num_threads(2)
        a = torch.arange(4_000_000, dtype=torch.float32)
        want = (a * 2).sum().item()
        tasks = lambda: len(os.listdir("/proc/self/task"))
        before = tasks()
        assert release_openmp_pool()
        deadline = time.monotonic() + 10
        while tasks() >= before and time.monotonic() < deadline:
            time.sleep(0.01)
        after = tasks()
        assert after < before, (before, after)
        assert (a * 2).sum().item() == want
        print("ok", before, after)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]
