"""docs/BENCHMARKS.md §1's preemption cost and §5's gateway throughput with each quota backend
are generated regions: the real `bench.engine.scheduling preemption` on the tiny model writes
JSON whose rows the report renders, and `bench.serving.gateway_overhead --redis --repeats`
writes every run, its renderer showing each run, the medians and Redis against embedded."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.engine import scheduling
from bench.renderers.engine_scheduling import render_preemption
from bench.renderers.gateway_overhead import render_backends, render_gateway_overhead
from bench.serving.gateway_overhead import make_trace

ROOT = Path(__file__).resolve().parents[1]


def _rows(text: str) -> dict[str, list[str]]:
    """A markdown table's body rows by their first cell."""
    out = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            out[cells[0]] = cells
    return out


def _report(tmp_path: Path, name: str, data_path: Path) -> str:
    """Render NAME from DATA_PATH through `bench report` into a one-region page; --check agrees."""
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    shutil.copy(data_path, results / f"{name}.json")
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# t\n\n<!-- generated: {name} -->\n<!-- /generated -->\n\nprose\n")
    assert report.main(["--doc", str(doc), "--results", str(results)]) == 0
    assert report.main(["--check", "--doc", str(doc), "--results", str(results)]) == 0
    return doc.read_text()


@pytest.mark.slow
def test_a_real_preemption_run_renders_its_rows(tiny_model, tmp_path):
    """Two context lengths on the tiny model: each row's block count and bytes follow from the
    model's shape (every block out and back in), and the report's row shows the JSON's medians
    and their ratio."""
    model = tiny_model("llama")
    out = tmp_path / "preemption.json"
    assert scheduling.main(["preemption", "--model", model, "--contexts", "64,200", "--repeats", "2",
                            "--json-out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["provenance"]["benchmark"] == "engine.scheduling" and data["args"]["mode"] == "preemption"
    assert report.renderer_for(data) is render_preemption
    result = data["result"]
    cfg = json.loads((Path(model) / "config.json").read_text())
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[data["dtype"]]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * result["block_size"] * cfg["num_key_value_heads"] * head_dim * elem
    assert [r["context_tokens"] for r in result["rows"]] == [64, 200]
    for r in result["rows"]:
        assert r["blocks"] == -(-r["context_tokens"] // result["block_size"])
        assert r["swap_bytes"] == 2 * r["blocks"] * per_block
        assert len(r["recompute_s"]) == len(r["swap_out_and_in_s"]) == 2
        assert r["recompute_s_median"] == statistics.median(r["recompute_s"]) > 0
        assert r["swap_out_and_in_s_median"] == statistics.median(r["swap_out_and_in_s"]) > 0

    text = _report(tmp_path, "preemption", out)
    rows = _rows(text)
    assert set(rows) == {"context tokens", "64", "200"}
    for r in result["rows"]:
        row = rows[f"{r['context_tokens']:,}"]
        assert row[1:] == [f"{r['recompute_s_median'] * 1000:,.1f} ms", f"{r['swap_out_and_in_s_median'] * 1000:,.1f} ms",
                           f"{r['swap_bytes'] / 2**20:,.1f} MiB",
                           f"**{r['recompute_s_median'] / r['swap_out_and_in_s_median']:,.0f}×**"]
    assert "median of 2 of each" in text and "blocks of 16 tokens" in text
    assert "JSON: [docs/bench/results/preemption.json]" in text and text.endswith("prose\n")


def _run(tps: float, ttft: float = 1500.0, idle: float = 120.0) -> dict:
    return {"tokens_per_s": tps, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "idle_ttft_p50_ms": idle}


def _prov() -> dict:
    return {"benchmark": "serving.gateway_overhead", "command": "python -m bench.serving.gateway_overhead --modes sse --redis",
            "commit": "abc1234", "dirty": False, "host": "h", "cpu": "CPU X", "started": "2026-12-02T01:00:00Z",
            "finished": "2026-12-02T01:20:00Z", "loadavg_start": 0.5, "loadavg_end": 1.5}


def test_backends_table_gives_each_run_the_medians_and_redis_against_embedded():
    """A `--redis --repeats 3` run without the in-process mode renders as the backends' table:
    every run's tokens/s, the median, the half-range over the median, Redis's median against the
    embedded one's, the median run's latencies. A run with the in-process mode stays the overhead
    table."""
    runs = {"sse": [_run(40.0), _run(44.0, 1000.0, 110.0), _run(36.0)],
            "sse+redis": [_run(39.0, 1200.0, 118.5), _run(41.0), _run(38.0)]}
    data = {"provenance": _prov(), "args": {"requests": 64, "rate": 4.0, "max_tokens": 96, "idle": 16, "redis": "local",
                                            "repeats": 3},
            "results": {"sse": runs["sse"][0], "sse+redis": runs["sse+redis"][0]}, "runs": runs}
    assert report.renderer_for(data) is render_gateway_overhead
    text = render_gateway_overhead(data, "gateway-backends")
    assert text == render_backends(data, "gateway-backends")
    assert "3 runs of each mode in turn" in text and "24–96 output tokens" in text
    rows = _rows(text)
    assert rows["gateway, SSE, embedded quotas"][1:] == ["40.0 / 44.0 / 36.0", "40.0", "±10.0%", "—",
                                                         "1.50 s / 3.00 s", "120.0 ms"]
    assert rows["gateway, SSE, Redis quotas"][1:] == ["39.0 / 41.0 / 38.0", "39.0", "±3.8%", "**-2.5%**",
                                                      "1.20 s / 2.40 s", "118.5 ms"]
    with_inprocess = {**data, "results": {"inprocess": _run(50.0), **data["results"]}}
    assert "vs in-process `AsyncEngine`" in render_gateway_overhead(with_inprocess, "gateway-overhead")


@pytest.mark.slow
@pytest.mark.e2e
def test_a_real_gateway_backends_run_keeps_every_run_and_renders(tiny_model, tmp_path):
    """`--modes sse --redis --repeats 2` on the tiny model (a local redis-server, a fresh
    `streamgate serve` a run): "runs" holds both runs of each mode with every token served,
    "results" the median one, and the report's rows show them."""
    if shutil.which("redis-server") is None and not Path("/usr/bin/redis-server").exists():
        pytest.fail("redis-server is not installed (scripts/ensure_redis.sh)")
    out = tmp_path / "gb.json"
    cmd = [sys.executable, "-m", "bench.serving.gateway_overhead", "--model", tiny_model("llama"), "--modes", "sse",
           "--redis", "--repeats", "2", "--requests", "3", "--rate", "0", "--max-tokens", "4", "--idle", "1",
           "--json-out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert set(runs) == set(data["results"]) == {"sse", "sse+redis"}
    trace_tokens = sum(r["max_tokens"] for r in make_trace(3, 0.0, 4, 0))
    for mode, rs in runs.items():
        assert len(rs) == 2 and all(r["output_tokens"] == trace_tokens for r in rs), mode
        assert data["results"][mode] in rs and data["results"][mode]["tokens_per_s"] == min(r["tokens_per_s"] for r in rs)
    rows = _rows(_report(tmp_path, "gb", out))
    for label, mode in (("gateway, SSE, embedded quotas", "sse"), ("gateway, SSE, Redis quotas", "sse+redis")):
        tps = [r["tokens_per_s"] for r in runs[mode]]
        assert rows[label][1:3] == [" / ".join(f"{x:.1f}" for x in tps), f"{statistics.median(tps):.1f}"]
    ratio = statistics.median(r["tokens_per_s"] for r in runs["sse+redis"]) / statistics.median(
        r["tokens_per_s"] for r in runs["sse"]) - 1
    assert rows["gateway, SSE, Redis quotas"][4] == f"**{ratio:+.1%}**"


def test_the_preemption_and_backend_regions_are_published_with_their_json():
    """§1's preemption and §5's gateway-backends regions are on the page, each JSON a real run
    (its command a bench module) that renders with its table: the preemption rows, and every
    run of both quota backends (`python -m bench report --check` is tests/test_bench_report.py's)."""
    regions = set(report.REGION.findall(report.DOC.read_text()))
    assert {"preemption", "gateway-backends"} <= regions
    pre = json.loads((report.RESULTS / "preemption.json").read_text())
    assert report.renderer_for(pre) is render_preemption
    assert pre["provenance"]["command"].startswith("python -m bench.engine.scheduling preemption")
    assert [f"{r['context_tokens']:,}" for r in pre["result"]["rows"]] == list(_rows(render_preemption(pre, "p")))[1:]
    gb = json.loads((report.RESULTS / "gateway-backends.json").read_text())
    assert gb["provenance"]["command"].startswith("python -m bench.serving.gateway_overhead")
    assert set(gb["runs"]) == {"sse", "sse+redis"} and "inprocess" not in gb["results"]
    assert render_gateway_overhead(gb, "gateway-backends") == render_backends(gb, "gateway-backends")
