"""The bf16 contract (tests/bf16.py) can fail: a bf16 run with a deliberately broken kernel (the
heads of the attention output in the wrong order, or the keys' head_dim packed in the wrong
order) is refused, by a wide margin, where the same run with the real kernel passes."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import paged_attention_ops
from tests.bf16 import SKIP_REASON, assert_tokens_within_noise, runs_here
from tests.models import run_to_completion

pytestmark = [pytest.mark.skipif(not runs_here(), reason=SKIP_REASON),
              pytest.mark.skipif(paged_attention_ops() is None, reason="the C++ kernels did not build")]


def _out(args) -> torch.Tensor:
    """The kernel's output argument: the tensor shaped like the query (its first argument)."""
    return next(a for a in reversed(args) if isinstance(a, torch.Tensor) and a.shape == args[0].shape)


def heads_rolled(real):
    def op(*args):
        real(*args)
        out = _out(args)
        out.copy_(out.roll(1, dims=1))                 # [N, H, D]: head h gets head h-1's output
    return op


def keys_permuted(real):
    def op(*args):
        args = list(args)
        args[1] = args[1].flip(-1)                     # the key pool [slots, H_kv, D], head_dim reversed
        real(*args)
    return op


def run(model: str) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(11)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    arrivals = {i: [(f"r{i}", [rng.randrange(100, 40_000) for _ in range(n)], params)]
                for i, n in enumerate([40, 7, 90])}
    engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16", attention_backend="kernel", num_kv_blocks=64,
                                    block_size=8, max_num_batched_tokens=48, max_num_seqs=8))
    # The breakages wrap the Python-visible operator; the one-call layer loop (csrc/llama_layers.cpp)
    # would reach the real one through the dispatcher, so this run keeps the Python loop.
    if getattr(engine.runner.forward, "cpp_layers", False):
        engine.runner.forward.cpp_layers = False
    out = run_to_completion(engine, arrivals)
    return {rid: (prompt, out[rid]) for reqs in arrivals.values() for rid, prompt, _ in reqs}


@pytest.mark.parametrize("breakage", [heads_rolled, keys_permuted])
def test_a_broken_kernel_fails_the_contract_a_sound_one_passes(tiny_model, breakage, monkeypatch):
    model = tiny_model("llama-slow")                    # head_dim 64: the bf16 dot-product paths
    tols = [assert_tokens_within_noise(model, prompt, got) for prompt, got in run(model).values()]
    monkeypatch.setattr(torch.ops.streamgate, "paged_attention", breakage(torch.ops.streamgate.paged_attention))
    broken = run(model)
    failures = []
    for prompt, got in broken.values():
        with pytest.raises(AssertionError, match="below the fp32 maximum") as caught:
            assert_tokens_within_noise(model, prompt, got)
        failures.append(str(caught.value).split("\n")[0])
    assert len(failures) == len(tols), (tols, failures)
