"""The serving benchmark end to end on a tiny model: `python -m bench.serving.serve` starts its own
gateway, replays a tiny workload over the WebSocket and writes its JSON (with its provenance,
rendered by docs/BENCHMARKS.md's renderer) and plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import report
from bench.renderers.serving import render_serve

ROOT = Path(__file__).resolve().parents[1]

TINY = """
name = "tiny"
seed = 0
num_requests = 5
duration_s = 10
rate = 20

[slo]
ttft_ms = 5000
tpot_ms = 1000

[[tenants]]
name = "a"
rate = 10

[[tenants]]
name = "b"
rate = 10
priority = 1

[[mix]]
name = "chat"
weight = 2
prompt_words = [5, 20]
max_tokens = [3, 6]

[[mix]]
name = "document"
weight = 1
prompt_words = [60, 120]
max_tokens = [3, 3]
long = true
"""


def _run(tmp_path, model: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    (tmp_path / "tiny.toml").write_text(TINY)
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "bench.serving.serve", "--workload", str(tmp_path / "tiny.toml"), "--model", model,
           "--json-out", str(out), "--plots-dir", str(tmp_path / "plots"), "--time-limit", "60", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["provenance"]["command"] == "python -m bench.serving.serve " + " ".join(cmd[3:])
    return proc, data


def test_serve_bench_compares_presets_and_writes_results_and_plots(tiny_model, tmp_path):
    """`--compare static,chunked` runs each preset on its own server and prints them side by
    side. In each run every request succeeds with exactly max_tokens tokens (ignore_eos); the
    JSON has the summary, per-request timings and stats samples; every plot is a non-empty PNG.
    (One run of the benchmark for both checks: each server start is seconds of the suite.)"""
    proc, res = _run(tmp_path, tiny_model("llama"), "--compare", "static,chunked", "--num-requests", "4")
    assert [r["label"] for r in res["runs"]] == ["static", "chunked"]
    assert res["runs"][0]["flags"] == ["--batching", "static"] and res["runs"][1]["flags"] == []
    for run in res["runs"]:
        s = run["summary"]
        assert s["requests"] == s["ok"] == len(run["requests"]) == 4 and s["failures"] == {}, run["label"]
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms"):
            assert set(s[key]) >= {"p50", "p90", "p99", "max"}
        assert s["ttft_ms"]["p50"] > 0 and s["output_tps"] > 0 and 0 <= s["goodput"]["fraction"] <= 1
        assert abs(sum(t["share"] for t in s["tenants"].values()) - 1) < 1e-9
        for r in run["requests"]:
            assert r["output_tokens"] == r["max_tokens"] and r["finish"] == "length"
            assert r["send"] <= r["deltas"][0][0] <= r["end"] and r["queue_s"] is not None
        assert run["stats"] and {"waiting", "running", "kv_cache_usage", "num_preemptions"} <= set(run["stats"][0])
        # The server's per-tenant counters (GET /metrics) from before the first request to after
        # the last equal what the client was served: every prompt once, every output token.
        first, last = run["served"][0]["served"], run["served"][-1]["served"]
        for tenant in ("a", "b"):
            mine = [r for r in run["requests"] if r["tenant"] == tenant]
            assert mine, (run["label"], tenant)
            got = [x - y for x, y in zip(last[tenant], first.get(tenant, (0, 0)))]
            assert got == [sum(r["prompt_tokens"] for r in mine), sum(r["output_tokens"] for r in mine)]
        assert s["weighted_service"]["client"]["pair"] == ["a", "b"]
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert {p.name for p in pngs} == {"tiny-latency_cdf.png"} | {f"tiny-{label}-{plot}.png" for label in (
        "static", "chunked") for plot in ("itl_time", "tenant_tokens")}
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 1000 for p in pngs)
    header = proc.stdout.splitlines()[1]
    assert "static" in header and "chunked" in header
    assert "TTFT" in proc.stdout and " ms" in proc.stdout
    _renders(res, tmp_path)


def _renders(res: dict, tmp_path) -> None:
    """The run's JSON renders as docs/BENCHMARKS.md's region: a row per preset with the run's own
    counts, tok/s and weighted splits, under a caption naming the command and the build."""
    prov = res["provenance"]
    assert prov["benchmark"] == "serving.serve" and prov["cpu"] and prov["started"] <= prov["finished"]
    assert report.renderer_for(res) is render_serve
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "serve-tiny.json").write_text(json.dumps(res))
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# t\n\n<!-- generated: serve-tiny -->\n<!-- /generated -->\n")
    assert report.main(["--doc", str(doc), "--results", str(tmp_path / "results")]) == 0
    text = doc.read_text()
    assert f"`{prov['command']}`, commit `{prov['commit']}`" in text
    head, _, *body = [[c.strip() for c in line.strip("|").split(" | ")] for line in text.splitlines()
                      if line.startswith("|")]
    rows = {cells[0]: dict(zip(head, cells)) for cells in body}
    static_tps = res["runs"][0]["summary"]["output_tps"]
    for run in res["runs"]:
        s, row = run["summary"], rows[run["label"]]
        assert row["ok / sent"] == f"{s['ok']} / {s['requests']}" == "4 / 4"
        assert row["output tok/s (× static)"].startswith(f"{s['output_tps']:.1f}")
        assert run["label"] == "static" or f"({s['output_tps'] / static_tps:.2f}×)" in row["output tok/s (× static)"]
        assert s["preemptions_per_request"] == s["preemptions"] / s["requests"]
        assert row["preemptions / request"] == f"{s['preemptions_per_request']:.2f}"
        client = s["weighted_service"]["client"]
        assert row["weighted a : b (client's records)"].startswith(f"**{client['split']:.2f} : 1**")
        server = s["weighted_service"]["server"] or {}        # too few samples in so short a run: no column
        assert "split" not in server or row["weighted a : b (server's counters)"].startswith(f"**{server['split']:.2f}")
    assert report.main(["--check", "--doc", str(doc), "--results", str(tmp_path / "results")]) == 0
