"""`bench.serving.pooled` end to end on a tiny model, in process: per seed the tenant alone, then
each preset; TTFTs pooled per system over the seeds."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.serving.pooled import seed_list, ttfts
from bench.serving.servestats import request_metrics

TINY = """
name = "tiny"
seed = 0
num_requests = 8
duration_s = 10

[[tenants]]
name = "a"
rate = 4

[[tenants]]
name = "b"
rate = 8

[[mix]]
name = "chat"
weight = 1
prompt_words = [5, 20]
max_tokens = [2, 5]
"""


def test_pooled_runs_alone_then_each_preset_per_seed_and_pools(tiny_model, tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    out = tmp_path / "pooled.json"
    cmd = [sys.executable, "-m", "bench.serving.pooled", "--workload", str(tmp_path / "tiny.toml"), "--tenant", "a",
           "--seeds", "1-2", "--compare", "fcfs,fair", "--driver", "inprocess", "--model", tiny_model("llama"),
           "--time-limit", "60", "--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(r["seed"], r["label"]) for r in res["runs"]] == [
        (s, label) for s in (1, 2) for label in ("a-alone", "fcfs", "fair")]
    for label in ("a-alone", "fcfs", "fair"):
        mine = [rec for r in res["runs"] if r["label"] == label for rec in r["requests"] if rec["tenant"] == "a"]
        assert mine and all(request_metrics(rec)["ok"] for rec in mine)
        assert sorted(res["pooled"][label]) == sorted(request_metrics(rec)["ttft"] for rec in mine)
    alone_runs = [r for r in res["runs"] if r["label"] == "a-alone"]
    assert all({rec["tenant"] for rec in r["requests"]} == {"a"} for r in alone_runs)
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[2:] if line.strip()[:1].isalpha()}
    assert "(x1.00)" in rows["a-alone"] and rows["a-alone"].endswith("[1.00 1.00]")
    assert set(rows) >= {"a-alone", "fcfs", "fair"}


def test_seed_list_and_a_request_without_a_first_token_counts_as_infinite():
    assert seed_list("1-3") == [1, 2, 3] and seed_list("2,5") == [2, 5]
    ok = {"tenant": "a", "send": 1.0, "end": 2.0, "deltas": [[1.5, 1], [2.0, 1]], "error": None}
    failed = {"tenant": "a", "send": 1.0, "end": 3.0, "deltas": [], "error": "time_limit"}
    other = {**ok, "tenant": "b"}
    assert ttfts({"requests": [ok, failed, other]}, "a") == [0.5, float("inf")]
