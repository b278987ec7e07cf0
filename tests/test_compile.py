"""Decode steps padded to buckets (the CUDA-graph path): greedy parity with HF on the CPU,
with the padding run eagerly, and on CUDA (skipped without one) recorded as CUDA graphs.
The compiled CPU path's parity test is test_parity.py::test_greedy_parity_compiled."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine
from engine.cuda_graphs import DecodeGraphs, bucket
from engine.kv_cache import PagedKVCache
from tests.conftest import NO_CUDA, cuda_available
from tests.test_parity import assert_parity, mixed_workload

# Small blocks and a small pool: contexts span several blocks (width buckets 1..16) and
# the pool forces recompute preemption; 8 seats give row buckets 1..8.
CONFIG = dict(num_kv_blocks=20, block_size=8, max_num_batched_tokens=64, max_num_seqs=8, watermark=0.0)


def test_bucket_is_the_next_power_of_two():
    """Rows and context widths pad to the next power of two, exact powers staying put."""
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 31, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 32, 64]


def test_padded_decode_steps_keep_parity_on_cpu(tiny_model):
    """The CUDA-graph path's padding, run eagerly on the CPU: decode steps padded to row and
    width buckets (padded rows on the scratch block, not sampled) beside chunked prefill and
    preemption still equal HF greedy; the padded rows wrote the scratch block. (transformers'
    forward, as on CUDA: the CPU's fused Llama forward is off.)"""
    model_dir = tiny_model("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, device="cpu", dtype="float32", attention_backend="torch",
                                    fused_layers=False, **CONFIG))
    runner = engine.runner
    # What the runner builds on CUDA: a pool with one block more, the scratch block.
    old = runner.kv_cache
    runner.kv_cache = PagedKVCache(old.num_layers, runner.num_blocks + 1, old.block_size, old.k.shape[2],
                                   old.k.shape[3], old.k.dtype, old.k.device)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.num_blocks, 8, runner.device)
    scratch = slice(runner.num_blocks * 8, None)
    arrivals = mixed_workload(8, [40, 70, 20, 90, 3], max_new=16, seed=1)
    assert_parity(engine, model_dir, "cpu", "float32", arrivals)
    assert engine.stats()["num_preemptions"] > 0
    assert runner.graphs.num_steps > 20
    assert runner.kv_cache.k[:, scratch].abs().sum() > 0               # padded rows wrote there


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason=NO_CUDA)
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "no-graphs"])
def test_cuda_decode_graphs_keep_parity(tiny_model, cuda_graphs):
    """On CUDA with compile: decode steps replay CUDA graphs per bucket (none skipped) and
    prefill steps run eager, equal to HF greedy; with cuda_graphs=False no graph is recorded."""
    from torch._dynamo.utils import counters

    model_dir = tiny_model("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", compile=True,
                                    cuda_graphs=cuda_graphs, **CONFIG))
    skips = counters["inductor"]["cudagraph_skips"]
    assert_parity(engine, model_dir, "cuda", "bfloat16", mixed_workload(8, [40, 70, 20, 90, 3], max_new=16, seed=1))
    assert engine.stats()["num_preemptions"] > 0
    if cuda_graphs:
        assert engine.runner.graphs.num_steps > 20
        assert counters["inductor"]["cudagraph_skips"] == skips, "a decode bucket was not recorded as a CUDA graph"
    else:
        assert engine.runner.graphs is None


def test_cuda_graphs_option_is_validated_and_parsed():
    """cuda_graphs must be a bool (the error names the field); `--no-cuda-graphs` turns it off."""
    import argparse

    from engine.config_cli import add_engine_args, engine_config_from_args

    with pytest.raises(ValueError, match="EngineConfig.cuda_graphs"):
        EngineConfig(model="default", cuda_graphs="no")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--compile"])).cuda_graphs is True
    assert engine_config_from_args(p.parse_args(["--compile", "--no-cuda-graphs"])).cuda_graphs is False
