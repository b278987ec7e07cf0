"""The offline benchmark runs end to end on a tiny model and its systems agree."""

from __future__ import annotations

import json
import subprocess
import sys


def test_offline_benchmark_smoke(tiny_model, tmp_path):
    """`python -m bench.offline` on 6 short requests: every system produces all tokens, the
    engine's greedy tokens equal HF's, and the engine's step statistics are reported."""
    out = tmp_path / "offline.json"
    cmd = [sys.executable, "-m", "bench.offline", "--systems", "engine,hf-static", "--num-requests", "6",
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
