"""Tensor parallelism on CPU with gloo, 2 ranks: greedy parity with one process and HF
under chunked prefill, prefix caching and both kinds of preemption (tiny Llama on the
kernel path, tiny Qwen2 on the torch path, tiny Qwen3 with its q/k norms,
a tiny Llama with tied embeddings; CUDA/NCCL where 2 GPUs exist), start-up errors,
an idle engine outliving its collective timeout, a hung rank failing the step within it,
and a rank killed under a real `streamgate serve`."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from bench.redis_server import free_port
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.dtypes import native_bf16_cpu
from engine.tp_runner import RankFailure
from tenants import hash_key
from tests.conftest import cuda_available
from tests.bf16 import assert_tokens_within_noise
from tests.models import assert_greedy_parity, load_reference, run_to_completion

from .redis_server import wait_healthy

TP_TIMEOUT_S = 3.0
# 30 blocks of 8 tokens for ~700 tokens of requests: deferral, recompute preemption of the
# short sequences and swap preemption of those >= 80 tokens; a 48-token budget chunks prefill.
PRESSURE = dict(num_kv_blocks=30, block_size=8, max_num_batched_tokens=48, max_num_seqs=8, watermark=0.0,
                num_swap_blocks=64, swap_min_tokens=80)


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if cuda_available() else 0


# (family, device, dtype, attention backend); CUDA needs 2 GPUs (scripts/gpu_check.sh runs it).
TWO_GPUS = "tensor parallelism on CUDA needs 2 GPUs (one per rank; NCCL refuses two ranks on one)"
ENGINES = [                     # the first three are also the supervision tests' (SUPERVISION)
    pytest.param(("llama", "cpu", "float32", "kernel"), id="llama-cpu-kernel"),
    pytest.param(("qwen2", "cpu", "float32", "torch"), id="qwen2-cpu-torch"),
    pytest.param(("llama", "cuda", "bfloat16", "torch"), id="llama-cuda-bf16",
                 marks=[pytest.mark.cuda, pytest.mark.skipif(cuda_devices() < 2, reason=TWO_GPUS)]),
    pytest.param(("qwen3", "cpu", "float32", "kernel"), id="qwen3-cpu-kernel"),
    # lm_head shares the embedding's weights, as in SmolLM2
    pytest.param(("llama-tied", "cpu", "float32", "torch"), id="llama-tied-cpu-torch"),
    # bf16 where the CPU has bf16 dot products (elsewhere it is emulated, minutes a run)
    pytest.param(("llama", "cpu", "bfloat16", "kernel"), id="llama-cpu-bf16-kernel",
                 marks=pytest.mark.skipif(not native_bf16_cpu(), reason="no AVX512-BF16 or AMX-bf16: bf16 is emulated")),
]
IDLE_SINCE: dict[int, float] = {}   # id(TP engine) -> when it last finished a request (or started)


def workload(seed: int = 3) -> dict[int, list[tuple]]:
    """Eight prompts of 5..160 tokens, one arriving per step; every third starts with the same
    40 tokens (prefix cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40_000) for _ in range(40)]
    arrivals: dict[int, list[tuple]] = {}
    for i, n in enumerate([60, 5, 90, 30, 120, 17, 45, 75]):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(100, 40_000) for _ in range(n)]
        params = SamplingParams(max_tokens=24 - i % 3 * 4, temperature=0.0, ignore_eos=True)
        arrivals.setdefault(i, []).append((f"r{i}", prompt, params))
    return arrivals


@pytest.fixture(scope="module", params=ENGINES)
def tp_engine(request, tiny_model):
    """One 2-rank engine per family and device, shared by the module's tests (spawning ranks
    costs seconds)."""
    family, device, dtype, backend = request.param
    # the short timeout only where the supervision tests wait it out: elsewhere a rank
    # descheduled on a busy host (make test runs two workers) must not fail a parity run
    timeout = TP_TIMEOUT_S if request.param in [p.values[0] for p in ENGINES[:3]] else 60.0
    cfg = EngineConfig(model=tiny_model(family), device=device, dtype=dtype, attention_backend=backend,
                       tensor_parallel_size=2, tp_timeout_s=timeout, **PRESSURE)
    engine = LLMEngine(cfg)
    IDLE_SINCE[id(engine)] = time.monotonic()
    yield engine
    engine.close()
    assert all(not p.is_alive() for p in engine.runner.ranks.procs)


def test_tp_greedy_parity_with_one_process_and_hf(tp_engine):
    """Mixed arrivals with chunked prefill, prefix hits, recompute and swap preemption:
    2 ranks match HF generate, and in fp32 give exactly the single-process engine's tokens."""
    cfg = tp_engine.config
    got = run_to_completion(tp_engine, workload())
    IDLE_SINCE[id(tp_engine)] = time.monotonic()
    stats = tp_engine.stats()
    assert stats["preemptions_recompute"] > 0 and stats["preemptions_swap"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["kv_blocks_used"] == 0
    if cfg.dtype == "float32":       # bf16 sums the shards' halves in another order: near-ties may flip
        one = LLMEngine(EngineConfig(model=cfg.model, attention_backend=cfg.attention_backend, **PRESSURE))
        assert got == run_to_completion(one, workload())
    for reqs in workload().values():
        for rid, prompt, params in reqs:
            assert len(got[rid]) == params.max_tokens
            if cfg.dtype == "float32":
                assert_greedy_parity(load_reference(cfg.model, cfg.device, cfg.dtype), prompt, got[rid], 1e-4)
            else:                    # the bf16 contract (tests/bf16.py), against fp32
                assert_tokens_within_noise(cfg.model, prompt, got[rid], cfg.device.split(":")[0])


def test_each_rank_holds_its_share_of_kv_heads(tp_engine):
    """Rank 0's KV pool is sized for num_key_value_heads / 2 heads, with the configured blocks."""
    hf = tp_engine.runner.model.config
    k = tp_engine.runner.kv_cache.k                            # [L, S, H_kv_local, D]
    assert k.shape[2] == hf.num_key_value_heads // 2
    assert k.shape[1] == PRESSURE["num_kv_blocks"] * PRESSURE["block_size"]


# The heartbeat and the step timeout are the rank group's (engine/tp_runner.py), the same for
# every family, dtype and attention backend: one CPU engine per backend waits them out (each
# costs ~TP_TIMEOUT_S of waiting), and the CUDA one where two GPUs exist.
# The subset keeps each engine's index in ENGINES, by which pytest groups a module fixture's
# tests (so each engine is built once and the hung-rank test stays its last).
SUPERVISION = pytest.mark.parametrize("tp_engine", ENGINES[:3], indirect=True)


@SUPERVISION
def test_idle_engine_outlives_the_collective_timeout(tp_engine):
    """Heartbeats keep idle ranks in step: after idling past tp_timeout_s, a request still runs."""
    idle = time.monotonic() - IDLE_SINCE[id(tp_engine)]     # the parity test's references ran meanwhile
    time.sleep(max(0.0, TP_TIMEOUT_S + 1.5 - idle))
    tp_engine.check_health()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = run_to_completion(tp_engine, {0: [("idle", [11, 12, 13], params)]})
    assert len(out["idle"]) == 4


@SUPERVISION
def test_hung_rank_fails_the_step_within_the_timeout(tp_engine):
    """SIGSTOP rank 1 (runs last: it ends the shared engine): the next step's requests end
    with an error within about tp_timeout_s, health checks raise from then on, and close()
    still stops the frozen rank."""
    rank = tp_engine.runner.ranks.procs[0]
    os.kill(rank.pid, signal.SIGSTOP)
    tp_engine.add_request("hung", [11, 12, 13], SamplingParams(max_tokens=4, temperature=0.0))
    start = time.monotonic()
    outs = tp_engine.step()
    assert time.monotonic() - start < TP_TIMEOUT_S + 5
    assert [(o.request_id, o.finish_reason) for o in outs] == [("hung", "error")] and outs[0].error
    with pytest.raises(RankFailure):
        tp_engine.check_health()


def test_heads_that_do_not_divide_fail_at_start_naming_them(tiny_model):
    """tensor_parallel_size=3 on 4 query / 2 KV heads is refused before any rank starts."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3.*num_attention_heads=4, num_key_value_heads=2"):
        LLMEngine(EngineConfig(model=tiny_model("llama"), tensor_parallel_size=3))


@pytest.mark.skipif(cuda_devices() >= 2, reason="this machine has the GPUs")
def test_too_few_gpus_fail_at_start_naming_the_count(tiny_model):
    """tensor_parallel_size=2 on CUDA with fewer than 2 devices is refused before any rank starts."""
    with pytest.raises(ValueError, match=f"needs 2 CUDA devices, found {cuda_devices()}"):
        LLMEngine(EngineConfig(model=tiny_model("llama"), device="cuda", tensor_parallel_size=2))


def test_bad_tensor_parallel_settings_name_the_field():
    """A non-positive size, an indexed CUDA device or compile with TP is a ValueError naming the field."""
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="EngineConfig.device"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1")
    with pytest.raises(ValueError, match="EngineConfig.compile"):
        EngineConfig(tensor_parallel_size=2, compile=True)


def test_script_without_main_guard_fails_at_once_naming_the_guard(tiny_model, tmp_path):
    """A plain script that builds a TP engine at import time: the spawned rank re-imports it,
    fails in multiprocessing's bootstrapping, and dies. The parent raises naming the rank and
    the `__main__` guard instead of waiting out the group's 600 s start-up timeout."""
    script = tmp_path / "no_guard.py"
    script.write_text("from engine import EngineConfig, LLMEngine\n"
                      f"LLMEngine(EngineConfig(model={tiny_model('llama')!r}, tensor_parallel_size=2))\n"
                      "print('engine started')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode != 0 and "engine started" not in proc.stdout
    assert "rank 1" in proc.stderr and 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-3000:]


def _rank_processes(server: psutil.Process) -> list[psutil.Process]:
    return [p for p in server.children() if any("spawn_main" in part for part in p.cmdline())]


def test_killed_rank_fails_the_stream_and_health_and_sigterm_ends_the_tree(tiny_model, tmp_path):
    """`serve --tensor-parallel-size 2`: SIGKILL rank 1 mid-stream; the stream ends with an
    error event, /health turns 503 (without the exception's text, issue 25) while the server
    log names the rank, and SIGTERM ends every process."""
    key = "sk-tp-test"
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\napi_key_sha256 = ["{hash_key(key)}"]\n')
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # tests.held_serve: the real command, its engine holding the 1500-token stream after 16
    # tokens, so the stream is still running when rank 1 is killed whatever this host's speed
    proc = subprocess.Popen([sys.executable, "-m", "tests.held_serve", "serve", "--model", tiny_model("llama"),
                             "--tenants", str(tenants), "--port", str(port), "--drain-grace", "1",
                             "--tensor-parallel-size", "2", "--tp-timeout-s", str(TP_TIMEOUT_S),
                             "--attention-backend", "torch"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "w"))
    try:
        wait_healthy(url, proc, 180, lambda: (tmp_path / "serve.log").read_text()[-2000:])
        server = psutil.Process(proc.pid)
        ranks = _rank_processes(server)
        assert len(ranks) == 1
        events = []
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    ranks[0].kill()
        assert len(events) > 3 and "error" in events[-1], events[-3:]
        assert not any("error" in e for e in events[:-1])
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "engine failed" in health.text and "rank" not in health.text
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert "rank 1" in (tmp_path / "serve.log").read_text()
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()


def _exit_after(rank: int, delay_s: float, code: int, *parent_pid) -> None:
    time.sleep(delay_s)
    os._exit(code)


def test_a_failure_waits_for_the_dying_rank_and_names_it():
    """A collective fails as soon as a dying rank's sockets close, a moment before its process
    can be reaped: `dead_after_failure` waits (bounded) until the rank is seen gone, so the
    failure names it; with no rank dying it gives up after its wait."""
    from engine.distributed import Ranks

    ranks = Ranks(_exit_after, 2, (1.0, 7))
    try:
        assert ranks.dead() == []                            # still starting, or sleeping
        assert ranks.dead_after_failure(wait_s=60.0) == ["rank 1 (exit code 7)"]
    finally:
        ranks.stop(grace_s=0.0)
    alive = Ranks(_exit_after, 2, (60.0, 0))
    try:
        start = time.monotonic()
        assert alive.dead_after_failure(wait_s=0.3) == []
        assert time.monotonic() - start >= 0.3
    finally:
        alive.stop(grace_s=0.0)
