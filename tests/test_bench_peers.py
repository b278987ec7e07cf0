"""The peer benchmark (bench/peers*.py): GuideLLM's report parsed into rows, the table and
its ratios, server specs, and one real run of the harness with its own client against
streamgate on a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from bench.peers.report import ReportError, format_markdown, format_text, ratios, rows_from_guidellm
from bench.peers.servers import parse_server


def _dist(p50: float, p99: float) -> dict:
    """A GuideLLM distribution summary by request status, only the parts the parser reads
    plus a few it must ignore."""
    return {"successful": {"mean": (p50 + p99) / 2, "median": p50, "count": 9,
                           "percentiles": {"p50": p50, "p90": (p50 + p99) / 2, "p99": p99}},
            "errored": None, "incomplete": None}


def _benchmark(streams: int, duration: float, tokens: int, ok: int, errored: int,
               ttft: tuple[float, float], itl: tuple[float, float]) -> dict:
    return {"type_": "generative_benchmark", "config": {"strategy": {"type_": "concurrent", "streams": streams}},
            "duration": duration,
            "metrics": {"request_totals": {"successful": ok, "errored": errored, "incomplete": 0, "total": ok + errored},
                        "output_token_count": {"successful": {"total_sum": tokens, "mean": tokens / max(ok, 1)}},
                        "time_to_first_token_ms": _dist(*ttft), "inter_token_latency_ms": _dist(*itl)}}


def test_guidellm_report_becomes_one_row_per_concurrency():
    """Each benchmark of a concurrent-profile report is one row, sorted by streams, with
    output tok/s = successful output tokens / duration and the TTFT/ITL percentiles."""
    doc = {"benchmarks": [_benchmark(8, 20.0, 1000, 16, 0, (300.0, 900.0), (70.0, 90.0)),
                          _benchmark(1, 10.0, 128, 2, 1, (150.0, 200.0), (40.0, 45.0))]}
    rows = rows_from_guidellm(doc)
    assert [r["concurrency"] for r in rows] == [1, 8]
    one, eight = rows
    assert one["output_tps"] == pytest.approx(12.8) and eight["output_tps"] == pytest.approx(50.0)
    assert (one["ok"], one["failed"], one["output_tokens"]) == (2, 1, 128)
    assert (eight["ttft_p50_ms"], eight["ttft_p99_ms"], eight["itl_p50_ms"]) == (300.0, 900.0, 70.0)


def test_a_level_with_no_successful_request_has_no_latencies():
    """When every request of a level failed or was cut off, its TTFT and ITL are None (GuideLLM
    writes zeros there), and the table shows '-' rather than 0 ms."""
    rows = rows_from_guidellm({"benchmarks": [_benchmark(32, 300.0, 0, 0, 32, (0.0, 0.0), (0.0, 0.0))]})
    (row,) = rows
    assert (row["ok"], row["failed"], row["output_tps"]) == (0, 32, 0.0)
    assert row["ttft_p50_ms"] is row["ttft_p99_ms"] is row["itl_p50_ms"] is None
    assert "0 ms" not in format_text({"sg": rows}, None)[1]


def test_a_report_missing_a_metric_names_it():
    """A report without a metric the table needs fails with that metric's path."""
    bench = _benchmark(1, 10.0, 128, 2, 0, (1.0, 2.0), (1.0, 2.0))
    del bench["metrics"]["time_to_first_token_ms"]
    with pytest.raises(ReportError, match=r"metrics\.time_to_first_token_ms"):
        rows_from_guidellm({"benchmarks": [bench]})


def _row(c: int, tps: float, ttft99: float | None) -> dict:
    return {"concurrency": c, "ok": 4, "failed": 0, "output_tokens": 256, "output_tps": tps,
            "ttft_p50_ms": 100.0, "ttft_p99_ms": ttft99, "itl_p50_ms": 50.0, "itl_p99_ms": 60.0}


def test_ratios_are_against_the_peer_at_the_same_concurrency():
    """Output tok/s and TTFT p99 are divided by the peer's at the same concurrency; a level
    the peer lacks, or a missing number, gives None rather than a made-up ratio."""
    results = {"vllm": [_row(1, 20.0, 200.0), _row(32, 180.0, 4000.0)],
               "sg": [_row(1, 10.0, 300.0), _row(8, 40.0, 900.0), _row(32, 200.0, None)]}
    rel = ratios(results, "vllm")
    assert rel["sg"][1] == {"output_tps": pytest.approx(0.5), "ttft_p99": pytest.approx(1.5)}
    assert rel["sg"][8] == {"output_tps": None, "ttft_p99": None}
    assert rel["sg"][32]["output_tps"] == pytest.approx(200 / 180) and rel["sg"][32]["ttft_p99"] is None
    assert rel["vllm"][32]["output_tps"] == pytest.approx(1.0)


def test_text_and_markdown_tables_show_each_level_and_ratio():
    """Both tables have one line per server and level with its ratio; long TTFTs read in
    seconds; the markdown names the peer and carries the notes."""
    results = {"vllm": [_row(32, 180.0, 4200.0)], "sg": [_row(32, 90.0, 18600.0)]}
    text = format_text(results, "vllm")
    assert len(text) == 3 and "0.50x" in text[2] and "18.6 s" in text[2] and "4.43x" in text[2]
    md = format_markdown(results, "vllm", ["load average 3.1"])
    lines = md.splitlines()
    assert lines[0].startswith("| server |") and lines[3].startswith("| sg | 32 | 4/0 | 90.0 | 0.50x |")
    assert "against vllm" in md and "- load average 3.1" in md


def test_server_specs_parse_and_bad_ones_name_the_option():
    """NAME=KIND:FLAGS splits flags like a shell; a bare kind names itself; an unknown kind
    is refused naming --server."""
    spec = parse_server('sg-bf16=streamgate:--dtype bfloat16 --max-num-seqs "64"')
    assert (spec.name, spec.kind, spec.flags) == ("sg-bf16", "streamgate", ("--dtype", "bfloat16", "--max-num-seqs", "64"))
    assert parse_server("vllm").name == "vllm" and parse_server("vllm").flags == ()
    with pytest.raises(ValueError, match="--server"):
        parse_server("x=sglang")


def test_llamacpp_spec_picks_the_gguf_and_passes_the_rest_to_llama_server(tmp_path):
    """`--outtype` chooses which GGUF (converted once, then reused: here one is already there)
    and is not passed on; every other flag reaches llama-server after the harness's own, with
    a slot per stream of the largest level and the host's cores as threads."""
    from bench.peers import llamacpp

    binary = tmp_path / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "SmolLM2-q8_0.gguf").write_bytes(b"GGUF")
    spec = parse_server("lc=llamacpp:--outtype q8_0 --spec-type ngram-mod")
    cmd = llamacpp.command(str(binary), "/models/SmolLM2", 8123, spec.flags)
    assert cmd[0] == str(binary) and "--outtype" not in cmd
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "models" / "SmolLM2-q8_0.gguf")
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[-2:] == ["--spec-type", "ngram-mod"]
    assert int(cmd[cmd.index("--parallel") + 1]) == llamacpp.PARALLEL == 32
    assert int(cmd[cmd.index("--threads") + 1]) == os.cpu_count()
    assert llamacpp.split_flags(("--outtype=f32", "-b", "512")) == ("f32", ["-b", "512"])
    assert llamacpp.split_flags(()) == ("bf16", [])


def test_the_guidellm_command_line_is_logged_without_the_api_key(tmp_path, capsys):
    """The harness prints each GuideLLM command it runs; the streamgate server's key (a real
    tenant key for the run) is masked. A GuideLLM that fails names its log instead."""
    from bench.peers.clients import Load, run_guidellm

    key = "sg-secret-peers-key"
    with pytest.raises(RuntimeError, match="GuideLLM exited 1"):
        run_guidellm("false", "http://127.0.0.1:9", "m", str(tmp_path), key, Load(1, 1, 8, 4, 5.0), tmp_path)
    err = capsys.readouterr().err
    assert "running: false run" in err and "api_key=<key>" in err and key not in err


def test_guidellm_prefetches_only_the_prompts_the_level_sends(tmp_path):
    """GuideLLM's data loader is bounded by the level's request count (its default of 4,096
    prompts kept a core busy while the server was measured), and its request cap is the same."""
    from bench.peers.clients import Load, guidellm_command

    cmd = guidellm_command("guidellm", "http://127.0.0.1:9", "m", str(tmp_path), "k", Load(8, 16, 256, 64, 300.0),
                           tmp_path / "out.json")
    opts = {cmd[i + 1].split(",")[0]: dict(kv.split("=", 1) for kv in cmd[i + 1].split(","))
            for i, a in enumerate(cmd) if a in ("--data-loader", "--constraint")}
    assert opts["kind=pytorch"]["prefetch_factor"] == "16" and opts["kind=max_requests"]["count"] == "16"


def test_each_level_sends_prompts_no_earlier_level_sent(tmp_path):
    """A level re-sending the previous level's synthetic prompts is served by the prefix cache
    while the roofline's bound assumes them prefilled: GuideLLM gets a seed per level, and the
    loadgen client the run's prompts after those earlier levels sent."""
    from bench.peers.clients import Load, guidellm_command, level_prompts

    def seed(load):
        cmd = guidellm_command("guidellm", "http://127.0.0.1:9", "m", str(tmp_path), "k", load, tmp_path / "o.json")
        return cmd[cmd.index("--seed") + 1]

    levels = [Load(1, 8, 256, 64, 300.0, first=0), Load(8, 16, 256, 64, 300.0, first=8),
              Load(32, 64, 256, 64, 300.0, first=24)]
    assert len({seed(ld) for ld in levels}) == 3 and seed(levels[0]) == "kind=static,value=42"
    prompts = [f"p{i}" for i in range(88)]
    sent = [level_prompts(prompts, ld) for ld in levels]
    assert [len(x) for x in sent] == [8, 16, 64] and len(set().union(*sent)) == 88


def test_harness_runs_streamgate_with_its_own_client(tiny_model, tmp_path):
    """`python -m bench.peers --client loadgen` starts streamgate, measures two levels with
    every request producing exactly its output tokens, writes JSON and markdown, records
    the load average and threads, and stops the server; `--no-probe` leaves the roofline
    probes (bench/peers/probe.py) out."""
    cmd = [sys.executable, "-m", "bench.peers", "--client", "loadgen", "--model", tiny_model("llama"),
           "--server", "sg=streamgate:--max-num-seqs 8", "--peer", "sg", "--concurrency", "1,4",
           "--requests-per-stream", "1", "--min-requests", "2", "--prompt-tokens", "48", "--output-tokens", "5",
           "--max-seconds", "60", "--start-timeout", "120", "--out-dir", str(tmp_path), "--no-probe"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "peers.json").read_text())
    sg = report["servers"]["sg"]
    assert [(r["concurrency"], r["ok"], r["failed"], r["output_tokens"]) for r in sg["rows"]] == [(1, 2, 0, 10), (4, 4, 0, 20)]
    assert [(ld["requests"], ld["first"]) for ld in report["loads"]] == [(2, 0), (4, 2)]     # level 4's prompts new
    for r in sg["rows"]:
        assert r["output_tps"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["itl_p50_ms"] > 0
    assert sg["info"]["torch_threads"] >= 1 and sg["load_before"] >= 0
    assert "probe" not in report and not any("roofline_probe" in r for r in sg["rows"])
    assert "| sg | 4 | 4/0 |" in (tmp_path / "peers.md").read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(sg["url"] + "/health", timeout=2)


def test_grounded_prompts_are_refused_with_guidellm(capsys):
    """GuideLLM sends only its own synthetic prompts: `--workload grounded --client guidellm`
    is a usage error naming the loadgen client."""
    from bench.peers.run import main

    with pytest.raises(SystemExit) as exc:
        main(["--workload", "grounded", "--client", "guidellm"])
    assert exc.value.code == 2 and "--client loadgen" in capsys.readouterr().err


def _two_streamgates(workload: str, model: str, output_tokens: int, out) -> dict:
    """`python -m bench.peers --workload WORKLOAD` against sg and sg-spec (speculation k = 3),
    one stream, two requests; returns its peers.json."""
    cmd = [sys.executable, "-m", "bench.peers", "--workload", workload, "--model", model,
           "--server", "sg=streamgate", "--server", "sg-spec=streamgate:--num-speculative-tokens 3",
           "--peer", "sg", "--concurrency", "1", "--requests-per-stream", "1", "--min-requests", "2",
           "--output-tokens", str(output_tokens), "--max-seconds", "120", "--start-timeout", "120", "--out-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "peers.json").read_text())


def test_structured_run_sends_the_schema_and_both_servers_answer(tiny_model, tmp_path):
    """`--workload structured` sends bench.engine.speculative's JSON asks with a strict
    json_schema response_format and no ignore_eos (loadgen): one "json" row a level from each
    server, every request answered, none failed."""
    from bench.serving.drivers import chat_body
    from bench.serving.loadgen import Req

    body = chat_body(Req("r", "t", "c", None, 0, 0.0, [], 0, 9, extra={"ignore_eos": False, "response_format": {}}))
    assert body["ignore_eos"] is False and body["response_format"] == {} and body["max_tokens"] == 9
    report = _two_streamgates("structured", tiny_model("llama"), 24, tmp_path)
    assert report["args"]["workload"] == "structured" and report["args"]["client"] == "loadgen"
    for name in ("sg", "sg-spec"):
        rows = report["servers"][name]["rows"]
        assert [(r["workload"], r["concurrency"], r["ok"], r["failed"]) for r in rows] == [("json", 1, 2, 0)]
        assert rows[0]["output_tokens"] > 0 and rows[0]["output_tps"] > 0


def test_grounded_run_compares_streamgate_with_and_without_speculation(tiny_model, tmp_path):
    """`--workload grounded` (loadgen by default) sends bench.engine.speculative's edit and
    summarize messages to each server: one row per workload and level, every request
    producing exactly its output tokens, the prompt tokens as each server counted them
    (the same on both, edit's longer than summarize's); the report renders one table with a
    line per workload and level and both servers' columns."""
    from bench.engine.speculative import grounded_messages
    from bench.report import render

    report = _two_streamgates("grounded", tiny_model("llama"), 6, tmp_path)
    assert report["args"]["workload"] == "grounded" and report["args"]["client"] == "loadgen"
    counts = {}
    for name in ("sg", "sg-spec"):
        rows = report["servers"][name]["rows"]
        assert [(r["workload"], r["concurrency"], r["ok"], r["failed"], r["output_tokens"]) for r in rows] == \
            [("edit", 1, 2, 0, 12), ("summarize", 1, 2, 0, 12)]
        assert all(r["output_tps"] > 0 and r["ttft_p99_ms"] > 0 and r["itl_p50_ms"] > 0 for r in rows)
        counts[name] = {r["workload"]: r["prompt_tokens"] for r in rows}
    assert counts["sg"] == counts["sg-spec"]
    (edit,), (summarize,) = counts["sg"]["edit"], counts["sg"]["summarize"]
    assert summarize > 1000 and edit > summarize
    assert list(grounded_messages()) == ["edit", "summarize"]
    assert "| sg | edit | 1 | 2/0 |" in (tmp_path / "peers.md").read_text()

    text = render("peers", tmp_path)
    assert f"edit {edit}, summarize {summarize}" in text
    lines = text.splitlines()
    head = lines.index("| workload | streams | sg tok/s | sg-spec tok/s (× sg) | TTFT p99, sg / sg-spec "
                       "| ITL p50, sg / sg-spec |")
    assert [ln.split(" | ")[:2] for ln in lines[head + 2:head + 4]] == [["| edit", "1"], ["| summarize", "1"]]
