"""The offline benchmark runs end to end on a tiny model and its systems agree."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_offline_benchmark_smoke(tiny_model, tmp_path):
    """`python -m bench.engine.offline` on 6 short requests: every system produces all tokens, the
    engine's greedy tokens equal HF's, and the engine's step statistics are reported."""
    out = tmp_path / "offline.json"
    cmd = [sys.executable, "-m", "bench.engine.offline", "--systems", "engine,hf-static", "--num-requests", "6",
           "--max-prompt", "40", "--max-output", "10", "--threads", "1", "--kv-tokens", "2048",
           "--model-dir", tiny_model("llama"), "--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    engine, static = res["systems"]["engine"], res["systems"]["hf-static"]
    want = res["workload"]["output_tokens"]
    assert engine["output_tokens"] == static["output_tokens"] == want
    assert engine["agree_first16"] == 1.0
    assert 0.0 <= engine["overhead"] < 1.0 and 0.0 <= engine["kv_waste_at_peak"] < 1.0
    assert "engine" in proc.stdout and "hf-static" in proc.stdout


def test_hf_baselines_take_the_engine_dtype(tiny_model):
    """bench.engine.offline's HF baselines load in the dtype given to every system, "auto" resolved as
    the engine resolves it on this CPU, so the ratios compare like with like."""
    import torch

    from bench.engine.baselines import load_hf_model
    from engine.dtypes import resolve_dtype

    assert load_hf_model(tiny_model("llama")).dtype == torch.float32
    assert load_hf_model(tiny_model("llama"), "bfloat16").dtype == torch.bfloat16
    assert load_hf_model(tiny_model("llama"), "auto").dtype == resolve_dtype("auto", torch.device("cpu"))


def test_gemm_benchmark_prints_every_layer_and_form(tmp_path):
    """`python -m bench.engine.gemm` times each SmolLM2 layer shape in the four forms for each row count."""
    cmd = [sys.executable, "-m", "bench.engine.gemm", "--rows", "1,3", "--reps", "1", "--threads", "1",
           "--json-out", str(tmp_path / "gemm.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines()[2:] if not line.startswith("wrote ")]
    assert [(r[0], r[1]) for r in rows] == [(name, m) for name in ("q/k/v", "o", "gate/up", "down", "lm_head")
                                           for m in ("1", "3")]
    assert all(float(v) > 0 for r in rows for v in r[3:6])            # MKL fp32 and both bf16 forms ran


def test_attention_benchmark_runs_both_backends(capsys, tmp_path):
    """bench.engine.attention builds the torch backend's metadata with the engine's own builder and
    times both backends on decode rows and a chunk over context; the outputs agree."""
    from bench.engine.attention import main

    assert main(["--seqs", "2", "--min-ctx", "40", "--max-ctx", "60", "--chunk", "1,8", "--reps", "1",
                 "--threads", "1", "--json-out", str(tmp_path / "attention.json")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows[1:]] == ["1", "8"], rows
    assert all(float(r[4]) < 1e-3 for r in rows[1:]), rows                    # fp32: the same outputs
    import torch

    loads = torch.ops.streamgate.decode_span_loads()
    decode, chunk = json.loads((tmp_path / "attention.json").read_text())["rows"]
    assert decode["span_loads"] is loads and decode["kernel_other_walk_ms"] > 0  # the other walk, timed beside
    assert "kernel_other_walk_ms" not in chunk                                  # decode rows only
    assert torch.ops.streamgate.decode_span_loads() is loads                    # and the switch left as it was
    assert decode["kernel_one_part_ms"] > 0 and "kernel_one_part_ms" not in chunk   # rows whole, timed beside
    assert torch.ops.streamgate.decode_parts() is True                          # parts back on


def _amx_tiles() -> bool:
    from engine.kernels import paged_attention_ops

    ops = paged_attention_ops()
    return ops is not None and ops.amx_tiles()


@pytest.mark.skipif(not _amx_tiles(), reason="no AMX here (CPU without AMX-BF16, kernel variant without AVX512-BF16, "
                    "or STREAMGATE_AMX=0): nothing to time against its absence")
def test_attention_benchmark_times_amx_against_its_absence(capsys, tmp_path):
    """In bf16 on a CPU with AMX the kernel is timed with its AMX tiles and without them, and the
    switch is left as it was."""
    import torch

    from bench.engine.attention import main

    out = tmp_path / "attention.json"
    assert main(["--dtype", "bfloat16", "--case", "1x64-64/64", "--reps", "1", "--threads", "1",
                 "--json-out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["amx"] is True and data["rows"][0]["kernel_no_amx_ms"] > 0
    assert torch.ops.streamgate.amx_tiles() is True


def test_benchmarks_have_their_own_entry_point_and_the_gateway_never_imports_them():
    """`python -m bench NAME` (the `streamgate-bench` script) runs a benchmark; no module of
    gateway/ imports bench (the old `streamgate bench` spelling runs it in another process)."""
    import ast
    from pathlib import Path

    from bench.__main__ import benchmarks

    assert {"engine.offline", "engine.attention", "isolation", "peers", "serving.serve"} <= set(benchmarks())
    assert "workload" not in benchmarks() and "serving.loadgen" not in benchmarks()     # helpers, not benchmarks
    ok = subprocess.run([sys.executable, "-m", "bench", "engine.gemm", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "--rows" in ok.stdout and "deprecated" not in ok.stderr, ok.stderr[-2000:]
    old = subprocess.run([sys.executable, "-m", "bench", "gemm", "--help"], capture_output=True, text=True)
    assert old.returncode == 0 and "--rows" in old.stdout, old.stderr[-2000:]
    assert "`streamgate-bench gemm` is deprecated: use `streamgate-bench engine.gemm`" in old.stderr
    bad = subprocess.run([sys.executable, "-m", "bench", "nonesuch"], capture_output=True, text=True)
    assert bad.returncode == 2 and "benchmarks: " in bad.stderr
    for path in Path("gateway").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "bench" or n.startswith("bench.") for n in names), f"{path} imports {names}"


def test_the_runtime_wheel_leaves_bench_out_and_the_bench_distribution_has_every_wing():
    """pyproject.toml packages engine, gateway and tenants only; bench/pyproject.toml lists bench
    and every wing on disk, and the report's renderers (a new package not listed there would be
    missing from its wheel)."""
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    runtime = tomllib.loads(Path("pyproject.toml").read_text())
    include = runtime["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(fnmatch(pkg, pat) for pkg in ("bench", "bench.engine") for pat in include), include
    assert "streamgate-bench" not in runtime["project"]["scripts"]
    bench = tomllib.loads(Path("bench/pyproject.toml").read_text())
    wings = {f"bench.{p.parent.name}" for p in Path("bench").glob("*/__init__.py")}
    assert set(bench["tool"]["setuptools"]["packages"]) == {"bench", *wings}
    assert wings == {"bench.engine", "bench.serving", "bench.isolation", "bench.peers", "bench.renderers"}
    assert bench["project"]["scripts"]["streamgate-bench"] == "bench.__main__:main"


def test_families_benchmark_kv_and_speed(capsys, tiny_model, tmp_path):
    """`bench.engine.families kv`: freeing holds less than one table for all layers at the end of the
    conversation, for the all-sliding and the hybrid layouts; `speed` times a decode step of
    Llama's and gpt-oss's tiny models and estimates the MoE blocks' grouped GEMM."""
    from bench.engine import families

    kv = families.run_kv(type("A", (), {"tokens": 600, "prompt": 500, "block_size": 16})())
    for name in families.LAYOUTS:
        free, keep = kv[f"{name} / free"], kv[f"{name} / keep"]
        assert free["layer_blocks_end"] < keep["layer_blocks_end"] == keep["rows"] * 38
    rows = families.run_speed(type("A", (), {"families": "llama,gpt_oss", "seqs": 2, "steps": 3, "threads": 1,
                                             "smol": False, "profile": False})())
    assert rows["llama"]["generic"]["step_ms"] > 0 and rows["gpt_oss"]["fused"] is None
    moe = rows["gpt_oss"]["moe"]
    assert moe["moe_mlp_ms"] > 0 and 0 < moe["grouped_gemm_ms_estimate"]
    assert "gpt_oss MoE blocks" in capsys.readouterr().out
