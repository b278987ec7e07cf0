"""`bench.engine.profile_decode --forwards` and `--serving` write JSON that the report renders into
docs/BENCHMARKS.md (§1's decode steps, §8's torch.compile table). --forwards runs for real on the
tiny model, the report rewrites a page's region from its JSON, and every rendered cell is the
JSON's number (step medians, tokens per second, ratios). --serving does not run here (a cold
inductor cache compiles for ~40 s even on the tiny model): its renderer is checked on a run
written in the test."""

from __future__ import annotations

import json
import re
import statistics

from bench import report
from bench.renderers import RENDERERS
from bench.renderers.profile import render_forwards, render_serving


def _region(tmp_path, name: str) -> list[list[str]]:
    """The page region NAME rendered by `streamgate-bench report`, as table rows of cells (after
    checking the caption names the JSON and `--check` then finds the page up to date)."""
    doc = tmp_path / "PAGE.md"
    doc.write_text(f"# prose\n\n<!-- generated: {name} -->\n<!-- /generated -->\n\nafter\n")
    results = tmp_path / "results"
    assert report.main(["--doc", str(doc), "--results", str(results)]) == 0
    assert report.main(["--doc", str(doc), "--results", str(results), "--check"]) == 0
    text = doc.read_text()
    assert f"[docs/bench/results/{name}.json]" in text and text.endswith("<!-- /generated -->\n\nafter\n")
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]       # header dropped


def _num(cell: str) -> float:
    return float(re.match(r"[\d,.]+", cell)[0].replace(",", ""))


def test_forwards_rows_are_the_runs_medians(tiny_model, tmp_path):
    """Three decoding rows at one and two threads on the tiny model (in this process: torch's
    thread count is put back): one JSON row per thread count and forward path with its step
    times, and a table line for the batch whose cells give, at 1 / 2 threads, the fused path's
    median in ms, rows / median as tok/s, and each other path's median over the fused one's."""
    import torch

    from bench.engine.profile_decode import main

    out = tmp_path / "results" / "forwards.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--forwards", "--model-dir", tiny_model("llama"), "--seqs", "3", "--min-ctx", "8",
                     "--max-ctx", "20", "--steps", "3", "--threads", "1,2", "--json-out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    assert data["provenance"]["benchmark"] == "engine.profile_decode" and data["args"]["mode"] == "forwards"
    assert report.renderer_for(data) is render_forwards
    by = {(r["rows"], r["threads"], r["path"]): r for r in data["rows"]}
    assert set(by) == {(3, t, p) for t in (1, 2) for p in ("fused", "packed", "torch")}
    for r in by.values():
        assert len(r["times_s"]) == 3 and r["median_s"] == statistics.median(r["times_s"]) > 0
    [row] = _region(tmp_path, "forwards")
    assert row[:2] == ["3", "fp32"]
    fused = [by[3, t, "fused"]["median_s"] for t in (1, 2)]
    for got, want in zip(row[2].split(" / "), fused):                  # ms per step at 1 / 2 threads
        assert abs(float(got) - want * 1e3) <= 0.05
    for got, want in zip(row[3].split(" / "), fused):                  # tok/s
        assert abs(_num(got) - 3 / want) <= 0.5
    for cell, path in ((row[4], "packed"), (row[5], "torch")):         # a path's step over the fused one's
        for got, t in zip(cell.split(" / "), (1, 2)):
            assert abs(float(got.rstrip("×")) - by[3, t, path]["median_s"] / by[3, t, "fused"]["median_s"]) <= 0.005


def test_serving_ratio_reads_both_ways_and_unequal_step_counts_show():
    """A compiled run faster than eager reads 'faster' (the inverse ratio); step counts that
    differ between the engines are both shown; the report finds both renderers by mode."""
    run = {"dtype": "bfloat16", "threads": 2, "compile_time_s": 51.6, "graphs_startup": 3, "graphs_after_startup": 1,
           "graph_breaks": 0, "greedy_equal": 22, "requests": 32,
           "forward_s": {"compiled": {"decode-only": 1.08, "with prefill": 2.00},
                         "eager": {"decode-only": 0.64, "with prefill": 3.00}},
           "steps": {"compiled": {"decode-only": 40, "with prefill": 31},
                     "eager": {"decode-only": 40, "with prefill": 30}}}
    data = {"provenance": {"benchmark": "engine.profile_decode", "command": "python -m bench.engine.profile_decode",
                           "started": "2026-12-02T09:00:00Z", "finished": "2026-12-02T09:05:00Z"},
            "args": {"mode": "serving", "num_requests": 32, "max_prompt": 256, "max_output": 48}, "runs": [run],
            "loadavg_range": [2.5, 4.0]}
    text = render_serving(data, "compile")
    assert "| bf16 | 52 s | 1.08 / 0.64 s, 40 steps (**1.69× slower**) | 2.00 / 3.00 s, 31 / 30 steps " \
           "(1.50× faster) | 3 / 1 | 0 | 22 / 32 |" in text
    assert "load average 2.5–4.0" in text and "2 threads" in text
    assert RENDERERS["engine.profile_decode serving"] is render_serving
    assert RENDERERS["engine.profile_decode forwards"] is render_forwards
