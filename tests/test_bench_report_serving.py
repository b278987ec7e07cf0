"""The serving wing's tables in docs/BENCHMARKS.md (§3 pooled fairness, §4 isolation, §5 quota
backends and gateway overhead, §6 peers) are rendered from the JSON their benchmarks write:
each renderer on a small synthetic run (the numbers in the table follow from the input), a
real run of `bench.serving.quota_backends` and of `bench.peers` that renders, and the
published regions present with their JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.isolation.report import check_targets
from bench.renderers.gateway_overhead import render_gateway_overhead
from bench.renderers.isolation import render_isolation
from bench.renderers.peers import render_peers
from bench.renderers.pooled import render_pooled
from bench.renderers.quota_backends import render_quota_backends
from bench.renderers.serving import render_serve
from bench.serving.pooled import summary
from bench.serving.servestats import percentile

ROOT = Path(__file__).resolve().parents[1]
SERVING_REGIONS = {
    "pooled-fair": render_pooled, "pooled-priority": render_pooled, "pooled-policies": render_pooled,
    "isolation": render_isolation, "isolation-issue25": render_isolation, "quota-backends": render_quota_backends,
    "gateway-overhead": render_gateway_overhead, "peers-zen5-bf16": render_peers,
    "peers-zen1-fp32": render_peers, "peers-zen1-fp32-2threads": render_peers,
    "serve-mixed": render_serve, "serve-weighted": render_serve,
}
# Published runs moved to docs/bench/HISTORY.md (older builds and hosts): their JSON stays and must
# still render, but their region is no longer on the page.
MOVED_TO_HISTORY = {"peers-zen5-bf16", "peers-zen1-fp32", "peers-zen1-fp32-2threads", "serve-mixed"}


def _prov(benchmark: str, command: str) -> dict:
    return {"benchmark": benchmark, "command": command, "commit": "abc1234", "dirty": False, "host": "h",
            "cpu": "CPU X", "started": "2026-12-02T01:00:00Z", "finished": "2026-12-02T01:02:00Z",
            "loadavg_start": 0.5, "loadavg_end": 1.5}


def _rows(text: str) -> dict[str, list[str]]:
    """A markdown table's body rows by their first cell (stripped of backticks)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            out[cells[0].replace("`", "")] = cells
    return out


def test_pooled_rows_are_the_pooled_percentiles_over_alone_and_render():
    alone = [0.1, 0.2, 0.3, 0.4]
    fair = [0.2, 0.3, 0.5, 0.9]
    runs = [{"label": "a-alone", "summary": {"output_tps": 10.0}, "stats": [], "requests": [{}] * 4},
            {"label": "fair", "summary": {"output_tps": 60.0}, "stats": [{"num_preemptions": 3}], "requests": [{}] * 6},
            {"label": "fair", "summary": {"output_tps": 70.0}, "stats": [{"num_preemptions": 1}], "requests": [{}] * 2}]
    rows = summary({"a-alone": alone, "fair": fair}, {"a-alone": [1.0, 1.0], "fair": [1.5, 2.25]}, runs, "a-alone")
    fair_row = rows[1]
    assert fair_row["p90_s"] == percentile(fair, 90)
    assert fair_row["p90_x"] == pytest.approx(percentile(fair, 90) / percentile(alone, 90))
    assert fair_row["output_tps"] == 65.0 and fair_row["preemptions_per_request"] == 0.5
    data = {"provenance": _prov("serving.pooled", "python -m bench.serving.pooled --seeds 1-2"),
            "args": {"workload": "w", "tenant": "a", "seeds": "1-2", "driver": "inprocess"}, "summary": rows}
    assert report.renderer_for(data) is render_pooled
    table = _rows(render_pooled(data, "pooled-x"))
    p99 = percentile(fair, 99)
    assert table["fair"][4] == f"{p99:.2f} s ({p99 / percentile(alone, 99):.2f}×)"
    assert table["fair"][1:2] == ["4"] and table["fair"][5:] == ["65.0", "0.50", "1.50 2.25"]
    assert table["a-alone"][2] == f"{percentile(alone, 50):.2f} s"            # alone: no multiple of itself


def _serve_run(label: str, flags: list[str], tps: float, itl_long: tuple | None, weighted: dict | None = None) -> dict:
    ms = lambda p50, p99, mx=None: {"p50": p50, "p90": None, "p99": p99, "max": mx}  # noqa: E731
    return {"label": label, "preset": label, "flags": flags, "rate": None, "driver": "ws",
            "summary": {"requests": 10, "ok": 9, "output_tps": tps, "goodput": None, "preemptions_per_request": None,
                        "ttft_ms": ms(8.5, 23_300.0), "itl_ms": ms(485.0, 1810.0, 2080.0),
                        "itl_long_prefill_ms": ms(*itl_long) if itl_long else None, "weighted_service": weighted}}


def test_serve_rows_are_the_runs_summaries_against_the_targets():
    """One row a preset: × static and the ≥ 2× target on `continuous`, the long-prefill ITL ratio
    and its ≤ 2 target on chunked runs only, latencies with units; a column no run has is left out;
    a weighted split (server and client) appears as columns where a run has one."""
    runs = [_serve_run("static", ["--batching", "static"], 10.0, (100.0, 900.0)),
            _serve_run("continuous", ["--no-chunked-prefill"], 19.9, (300.0, 3000.0)),
            _serve_run("chunked", [], 25.0, (400.0, 600.0)),
            _serve_run("chunked-b64", ["--max-num-batched-tokens", "64"], 12.0, (400.0, 1000.0))]
    data = {"provenance": _prov("serving.serve", "python -m bench.serving.serve --compare x"),
            "args": {"workload": "mixed", "driver": "ws"},
            "workload": {"name": "mixed", "arrival": "poisson", "rate": 1.0, "num_requests": 10}, "runs": runs}
    assert report.renderer_for(data) is render_serve
    text = render_serve(data, "serve-x")
    assert "workload `mixed` (poisson at 1 req/s, up to 10 requests), driver ws" in text
    assert "goodput" not in text and "preemptions" not in text and "weighted" not in text
    rows = _rows(text)
    assert rows["static"][1:4] == ["`--batching static`", "9 / 10", "10.0"]
    assert rows["continuous"][3] == "19.9 (**1.99×**, missed)" and rows["chunked"][3] == "25.0 (2.50×)"
    assert rows["chunked"][4:7] == ["8.5 ms / 23.3 s", "485 ms / 1.81 s / 2.08 s", "3.73"]
    assert rows["static"][7] == "100 ms / 900 ms, 9.00" and rows["continuous"][7] == "300 ms / 3.00 s, 10.00"
    assert rows["chunked"][7] == "400 ms / 600 ms, **1.50** (met)"
    assert rows["chunked-b64"][7] == "400 ms / 1.00 s, **2.50** (missed)"
    runs[1]["summary"]["output_tps"] = 20.0
    assert _rows(render_serve(data, "serve-x"))["continuous"][3] == "20.0 (**2.00×**, met)"

    split = lambda x, err: {"pair": ["gold", "silver"], "split": x, "target": 2.0, "error": err}  # noqa: E731
    w = _serve_run("fair", ["--policy", "fair"], 9.0, None,
                   {"until_s": 303.4, "server": split(2.016, 0.008), "client": split(1.8, -0.1)})
    w["summary"]["preemptions_per_request"] = 0.24
    data = {**data, "runs": [w], "workload": {"name": "w", "arrival": "closed",
                                              "tenants": [{"name": "gold", "weight": 2.0}, {"name": "silver"}]}}
    text = render_serve(data, "serve-w")
    assert "(closed loop, weights gold 2, silver 1)" in text
    assert "| weighted gold : silver (server's counters) | weighted gold : silver (client's records) |" in text
    assert _rows(text)["fair"][-4:] == ["0.24", "**2.02 : 1** (target 2, +0.8 %)", "**1.80 : 1** (target 2, -10.0 %)",
                                        "0–303 s"]


def _phase(gap_max: float, health: float, ws: bool = True, outcome: str | None = "413 after 0.00 s") -> dict:
    return {"gap_max_ms": gap_max, "gap_max_from_s": 0.4, "gap_p50_ms": 100.0, "health_max_ms": health,
            "health_timeouts": 0, "rss_growth_mb": 2.0, "loop_cpu_ms": 30, "log": {"lines": 5, "error_lines": 0},
            "b_ws": {"connected": ws, "ms": 7.0} if ws else {"connected": False, "http_status": 429},
            "attacker": {"outcome": outcome} if outcome else None, "b_errors": [], "idle_after_s": 0.6,
            "loadavg_1m": 2.5}


def test_isolation_verdicts_follow_the_limits_and_render():
    phases = {"baseline": _phase(100.0, 8.0, outcome=None), "calm": _phase(249.0, 99.0),
              "gappy": _phase(301.0, 40.0), "sockets": _phase(120.0, 150.0, ws=False, outcome="429 | 1008")}
    targets = check_targets(phases)
    data = {"provenance": _prov("isolation", "python -m bench.isolation"), "server": {"exited_during": []},
            "args": {"b_max_tokens": 400, "shared_server": False}, "phases": phases, "targets": targets}
    text = render_isolation(data, "isolation")
    assert "**12 of 15 checks pass**" in text          # 5 checks an attack; misses: gappy 1, sockets 2
    assert "≤ 300 ms" in text and "load average 0.5–2.5" in text    # 3x the 100 ms baseline; phases' loads
    rows = _rows(text)
    assert rows["calm"][9] == "5 pass" and rows["gappy"][9] == "**MISS**: gap"
    assert rows["sockets"][9] == "**MISS**: health, ws" and rows["sockets"][6] == "**no**: HTTP 429"
    assert rows["gappy"][1] == "301 ms (+0.4 s)" and rows["sockets"][10] == "429 \\| 1008"   # a pipe stays in its cell


def test_quota_backends_table_shows_what_redis_adds_and_a_billing_mismatch():
    def row(added: float, billed: int) -> dict:
        x = {"n": 300, "admit+settle": {"p50_ms": 0.3, "p99_ms": 0.9}}
        return {"embedded": x, "redis": {**x}, "redis_two_step": {**x}, "redis_added_p50_ms": added,
                "redis_added_p99_ms": 4 * added, "redis_two_step_added_p50_ms": 2 * added,
                "redis_two_step_added_p99_ms": 5 * added, "redis_billed_tokens": billed, "redis_settled_tokens": 36_000,
                "ping_round_trip": {"p50_ms": 0.1, "p99_ms": 0.2}, "server_us_per_evalsha": 41.6}
    data = {"provenance": _prov("serving.quota_backends", "python -m bench.serving.quota_backends"),
            "args": {"redis": None}, "results": {"back_to_back": row(0.25, 36_000), "50_per_s": row(0.5, 35_880)}}
    rows = _rows(render_quota_backends(data, "quota-backends"))
    assert rows["back to back"][2] == "**0.25 / 1.00 ms**" and rows["back to back"][3] == "0.50 / 1.25 ms"
    assert rows["back to back"][7] == "yes (36,000)" and rows["back to back"][6] == "42"
    assert rows["50 req/s"][2] == "**0.50 / 2.00 ms**" and rows["50 req/s"][7] == "**no**: 35,880 of 36,000"


def test_gateway_overhead_is_against_the_first_mode():
    def r(tps: float, idle: float) -> dict:
        return {"tokens_per_s": tps, "ttft_p50_ms": 1500.0, "ttft_p99_ms": 4000.0, "idle_ttft_p50_ms": idle}
    data = {"provenance": _prov("serving.gateway_overhead", "python -m bench.serving.gateway_overhead"),
            "args": {"requests": 64, "rate": 4.0, "max_tokens": 96, "idle": 16},
            "results": {"inprocess": r(80.0, 120.0), "sse": r(76.0, 122.5), "ws+redis": r(84.0, 118.0)}}
    text = render_gateway_overhead(data, "gateway-overhead")
    rows = _rows(text)
    assert rows["in-process AsyncEngine"][2:] == ["—", "1.50 s / 4.00 s", "120.0 ms", "—"]
    assert rows["gateway, SSE"][2] == "**-5.0%**" and rows["gateway, SSE"][5] == "**+2.5 ms**"
    assert rows["gateway, WebSocket, Redis quotas"][2] == "**+5.0%**"
    assert "64 chat requests, Poisson 4 req/s, 24–96 output tokens" in text


def _peer_rows(tps: list[float], p99: list[float | None]) -> list[dict]:
    return [{"concurrency": c, "ok": 2, "failed": 0, "output_tps": t, "ttft_p50_ms": None, "ttft_p99_ms": q,
             "itl_p50_ms": 10.0 * (i + 1)} for i, (c, t, q) in enumerate(zip((1, 8, 32), tps, p99))]


def test_peers_ratios_are_against_the_peer_for_each_other_server():
    data = {"provenance": _prov("peers", "python -m bench.peers"),
            "args": {"peer": "vllm", "client": "guidellm", "prompt_tokens": 256, "output_tokens": 64},
            "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, "skipped": [],
            "servers": {"vllm": {"rows": _peer_rows([20.0, 80.0, 100.0], [1000.0, None, 4000.0]), "errors": [],
                                 "load_before": 3.0},
                        "sg": {"rows": _peer_rows([30.0, 60.0, 150.0], [1500.0, 900.0, 2000.0]), "errors": []},
                        "sg-fp32": {"rows": _peer_rows([10.0, 40.0, 50.0], [3000.0, 1.0, 8000.0]), "errors": []}}}
    text = render_peers(data, "peers-x")
    assert "**sg** against **vllm**" in text and "**sg-fp32** against **vllm**" in text
    assert "`VLLM_CPU_NUM_OF_RESERVED_CPU=0`" in text and "load average 0.5–3.0" in text
    sg, fp32 = text.split("**sg-fp32** against")
    rows, rows32 = _rows(sg), _rows(fp32)
    assert rows["1"][1:7] == ["20.0", "30.0", "**1.50×**", "1.00 s / 1.50 s", "1.50×", "10 / 10 ms"]
    assert rows["8"][3] == "**0.75×**" and rows["8"][4:6] == ["— / 0.90 s", "—"]     # the peer had no p99 there
    assert rows["32"][3] == "**1.50×**" and rows["32"][5] == "0.50×"
    assert rows32["32"][3] == "**0.50×**" and rows32["32"][5] == "2.00×"


def test_the_serving_regions_are_published_with_their_json():
    """Each of §3–§6's regions is in the page (the runs moved to the history excepted, and absent
    from it) and every JSON renders with the serving renderer (`python -m bench report --check`
    itself is tests/test_bench_report.py's)."""
    regions = set(report.REGION.findall(report.DOC.read_text()))
    assert set(SERVING_REGIONS) - MOVED_TO_HISTORY <= regions
    assert not MOVED_TO_HISTORY & regions
    for name, fn in SERVING_REGIONS.items():
        data = json.loads((report.RESULTS / f"{name}.json").read_text())
        assert report.renderer_for(data) is fn, name
        assert data["provenance"]["command"].startswith("python -m bench."), name


@pytest.mark.slow
def test_a_real_quota_backends_run_writes_json_that_renders(tmp_path):
    """A short real run (local redis-server) through --json-out: its JSON carries provenance,
    every settled token reached Redis, and the report renders it into a region."""
    if shutil.which("redis-server") is None and not Path("/usr/bin/redis-server").exists():
        pytest.fail("redis-server is not installed (scripts/ensure_redis.sh)")
    results = tmp_path / "results"
    out = results / "qb.json"
    cmd = [sys.executable, "-m", "bench.serving.quota_backends", "--requests", "30", "--rates", "0", "20",
           "--seconds", "0.5", "--json-out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["provenance"]["command"] == "python -m bench.serving.quota_backends " + " ".join(cmd[3:])
    assert list(data["results"]) == ["back_to_back", "20_per_s"]
    for row in data["results"].values():
        assert row["redis_billed_tokens"] == row["redis_settled_tokens"] > 0
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# t\n\n<!-- generated: qb -->\n<!-- /generated -->\n")
    assert report.main(["--doc", str(doc), "--results", str(results)]) == 0
    rows = _rows(doc.read_text())
    b2b = data["results"]["back_to_back"]
    assert rows["back to back"][1] == f"{b2b['redis']['n']:,}" == "30"
    assert rows["back to back"][2] == f"**{b2b['redis_added_p50_ms']:.2f} / {b2b['redis_added_p99_ms']:.2f} ms**"
    assert rows["20 req/s"][7] == f"yes ({data['results']['20_per_s']['redis_billed_tokens']:,})"
    assert report.main(["--check", "--doc", str(doc), "--results", str(results)]) == 0


@pytest.mark.slow
@pytest.mark.e2e
def test_a_real_peers_run_writes_the_json_its_renderer_reads(tiny_model, tmp_path):
    """`python -m bench.peers` (own client, a tiny model, streamgate against itself under two
    names) writes peers.json with provenance, and the report renders its rows."""
    cmd = [sys.executable, "-m", "bench.peers", "--client", "loadgen", "--model", tiny_model("llama"),
           "--server", "a=streamgate:--max-num-seqs 4", "--server", "b=streamgate:--max-num-seqs 4", "--peer", "a",
           "--concurrency", "1,2", "--requests-per-stream", "1", "--min-requests", "2", "--prompt-tokens", "32",
           "--output-tokens", "4", "--max-seconds", "60", "--start-timeout", "120", "--out-dir", str(tmp_path),
           "--probe-wait", "0.5"]                # make test's other worker keeps the machine busy
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["provenance"]["benchmark"] == "peers" and report.renderer_for(data) is render_peers
    a, b = ({r["concurrency"]: r for r in data["servers"][n]["rows"]} for n in ("a", "b"))
    assert set(a) == set(b) == {1, 2}
    rows = _rows(render_peers(data, "peers"))
    for c in (1, 2):
        assert rows[str(c)][1:4] == [f"{a[c]['output_tps']:.1f}", f"{b[c]['output_tps']:.1f}",
                                     f"**{b[c]['output_tps'] / a[c]['output_tps']:.2f}×**"]
        assert rows[str(c)][4] == f"{a[c]['ttft_p99_ms'] / 1000:.2f} s / {b[c]['ttft_p99_ms'] / 1000:.2f} s"
    # the roofline probed beside each level (bench/peers/probe.py), on by default: the probe after
    # one level is the probe before the next, each a real measurement of this host
    for name in ("a", "b"):
        probes = [r["roofline_probe"] for r in sorted(data["servers"][name]["rows"], key=lambda r: r["concurrency"])]
        assert probes[0]["after"] == probes[1]["before"] and probes[0]["before"] != probes[0]["after"]
        assert all(p[k]["read_bandwidth"] > 1e8 and p[k]["fresh_read_bandwidth"] > 1e8 and p[k]["bf16_flops"] > 1e8
                   for p in probes for k in ("before", "after"))
    assert data["probe"]["workload"]["prompt_tokens"] > 32             # the chat template's tokens counted
    assert "level's own bound, a / b" in render_peers(data, "peers")
