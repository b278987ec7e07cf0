"""docs/BENCHMARKS.md's generated tables are what `streamgate-bench report` renders from the
published JSON in docs/bench/results/, and a changed number in that JSON changes the page."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from bench import report
from bench.renderers.families import render_families_kv

ROOT = Path(__file__).resolve().parents[1]


def _copy(tmp_path: Path) -> tuple[Path, Path]:
    doc, results = tmp_path / "BENCHMARKS.md", tmp_path / "results"
    shutil.copy(report.DOC, doc)
    shutil.copytree(report.RESULTS, results)
    return doc, results


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_the_committed_page_is_what_the_report_renders():
    """`python -m bench report --check` on the committed docs: every generated region is up to date."""
    proc = subprocess.run([sys.executable, "-m", "bench", "report", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    regions = report.REGION.findall(report.DOC.read_text())
    assert {"families-kv", "speculative-bf16", "hosts", "peers-zen4-bf16", "peers-icelake-vnni"} <= set(regions)
    assert all((report.RESULTS / f"{name}.json").exists() for name in regions)


def test_a_changed_number_changes_the_table_fails_the_check_and_leaves_the_prose(tmp_path, capsys):
    doc, results = _copy(tmp_path)
    before = doc.read_text()

    def gemma(d):
        d["result"]["gemma3-1b (5:1, window 512) / free"]["layer_blocks_end"] = 1793

    spec = json.loads((results / "speculative-bf16.json").read_text())["rows"][0]
    old, new = f"| {spec['accepted']} / {spec['drafted']} |", f"| {spec['accepted'] + 1} / {spec['drafted']} |"

    def edit(d):
        d["rows"][0]["accepted"] += 1

    _edit(results / "families-kv.json", gemma)
    _edit(results / "speculative-bf16.json", edit)
    args = ["--doc", str(doc), "--results", str(results)]
    assert report.main(["--check", *args]) == 1
    assert "+| Gemma 3 1B" in capsys.readouterr().out          # the diff names the changed row
    assert doc.read_text() == before                            # --check writes nothing
    assert report.main(args) == 0
    after = doc.read_text()
    assert "| **1,793** (3.7x less) |" in after and "**1,792**" not in after
    assert new in after and old not in after
    assert report.REGION.sub("", after) == report.REGION.sub("", before)      # prose untouched
    assert report.main(["--check", *args]) == 0


def test_a_missing_json_or_an_unclosed_region_is_an_error(tmp_path, capsys):
    doc, results = _copy(tmp_path)
    (results / "speculative-bf16.json").unlink()
    assert report.main(["--check", "--doc", str(doc), "--results", str(results)]) == 2
    assert "speculative-bf16" in capsys.readouterr().err
    doc.write_text("# t\n\n<!-- generated: families-kv -->\nno end\n")
    assert report.main(["--check", "--doc", str(doc), "--results", str(results)]) == 2
    assert "<!-- /generated -->" in capsys.readouterr().err


def test_the_published_kv_table_is_what_the_block_manager_holds_now():
    """families-kv.json is exact and host-independent: re-running its arguments on today's block
    manager gives the same numbers, so the page cannot go stale behind the code either."""
    from bench.engine import families

    data = json.loads((report.RESULTS / "families-kv.json").read_text())
    a = data["args"]
    again = families.run_kv(type("A", (), {"tokens": a["tokens"], "prompt": a["prompt"],
                                          "block_size": a["block_size"]})())
    assert again == data["result"]


def test_a_benchmark_json_names_its_command_build_host_and_time(tmp_path):
    from bench.engine import families

    out = tmp_path / "kv.json"
    assert families.main(["kv", "--tokens", "600", "--prompt", "500", "--json-out", str(out)]) == 0
    prov = json.loads(out.read_text())["provenance"]
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert prov["command"] == f"python -m bench.engine.families kv --tokens 600 --prompt 500 --json-out {out}"
    assert prov["benchmark"] == "engine.families" and prov["commit"] == head.stdout.strip()
    assert prov["host"] and prov["cpu"] and prov["started"] <= prov["finished"]
    assert report.renderer_for(json.loads(out.read_text())) is render_families_kv
