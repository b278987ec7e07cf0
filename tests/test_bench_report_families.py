"""docs/BENCHMARKS.md §11's decode step per family is rendered from the JSON `bench.engine.families
speed` writes: a real run at its smallest settings goes through `streamgate-bench report`, and
every row of the table is that JSON's numbers; the published region is on the page."""

from __future__ import annotations

import json

from bench import report
from bench.engine import families
from bench.renderers.families import render_families_speed


def _rows(text: str) -> dict[str, list[str]]:
    """A markdown table's body rows by their first cell."""
    return {cells[0]: cells for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")
            for cells in [[c.strip() for c in line.strip("|").split(" | ")]]}


def test_a_real_speed_run_renders_its_json_rows(tmp_path, capsys):
    out = tmp_path / "results" / "families-speed.json"
    assert families.main(["speed", "--families", "llama,qwen3_moe", "--seqs", "2", "--steps", "2",
                          "--json-out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["provenance"]["benchmark"] == "engine.families" and data["args"]["mode"] == "speed"
    assert data["provenance"]["command"].startswith("python -m bench.engine.families speed --families")
    result = data["result"]
    assert set(result) == {"llama", "qwen3_moe"}
    assert result["qwen3_moe"]["fused"] is None and result["llama"]["fused"]["step_ms"] > 0
    assert (result["qwen3_moe"]["experts"], result["qwen3_moe"]["top_k"]) == (4, 2)
    assert {r["generic"]["dtype"] for r in result.values()} == {"float32"}

    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# t\n\nprose\n\n<!-- generated: families-speed -->\n<!-- /generated -->\n\nmore prose\n")
    assert report.main(["--doc", str(doc), "--results", str(out.parent)]) == 0
    page = doc.read_text()
    assert page.startswith("# t\n\nprose\n\n<!-- generated: families-speed -->\n") and page.endswith("more prose\n")
    assert "`python -m bench.engine.families speed --families llama,qwen3_moe" in page
    rows = _rows(page)
    llama, moe = result["llama"], result["qwen3_moe"]
    for label, r in (("llama", llama), ("Qwen3-MoE", moe)):
        g = r["generic"]
        assert rows[label][3] == f"{g['step_ms']:.2f} ({g['tokens_per_s']:,.0f})"
        assert rows[label][4] == f"{g['step_ms'] / llama['generic']['step_ms']:.2f}x"
    assert rows["llama"][2] == f"{llama['fused']['step_ms']:.2f} ({llama['fused']['tokens_per_s']:,.0f})"
    assert rows["Qwen3-MoE"][2] == "—"
    assert rows["Qwen3-MoE"][1] == f"{moe['generic']['non_embedding_params'] / 1e3:,.0f} K (4 experts, top 2)"
    assert (f"Qwen3-MoE's {moe['moe']['moe_mlp_ms']:.2f} ms of {moe['generic']['step_ms']:.2f} ms a step, against "
            f"{llama['generic']['mlp_ms']:.2f} ms for Llama's dense MLPs") in page
    assert report.main(["--check", "--doc", str(doc), "--results", str(out.parent)]) == 0


def _row(step_ms: float, non_emb: int, fused: float | None = None, mlp_ms: float | None = None) -> dict:
    g = {"step_ms": step_ms, "tokens_per_s": 8 / step_ms * 1e3, "non_embedding_params": non_emb, "steps": 27,
         "dtype": "float32", "attention": "kernel", "mlp_ms": mlp_ms}
    return {"generic": g, "fused": None if fused is None else {**g, "step_ms": fused, "tokens_per_s": 8 / fused * 1e3}}


def test_ratios_and_the_moe_line_follow_from_the_json():
    result = {"llama": _row(2.0, 74_000, fused=1.0, mlp_ms=0.1), "gpt_oss": _row(3.0, 126_000),
              "smollm2-135m": _row(50.0, 106_000_000, fused=40.0)}
    result["gpt_oss"].update(experts=4, top_k=2, moe={"moe_mlp_ms": 0.6, "grouped_gemm_ms_estimate": 0.1,
                                                      "saving_ms_per_step": 0.5})
    data = {"provenance": {"benchmark": "engine.families", "command": "python -m bench.engine.families speed",
                           "commit": "abc1234", "host": "h", "started": "2026-12-02T09:00:00Z",
                           "finished": "2026-12-02T09:00:30Z", "loadavg_start": 1.0, "loadavg_end": 2.0},
            "args": {"mode": "speed", "seqs": 8, "threads": 1}, "env": {"threads": 1, "prompt_tokens": 32},
            "result": result}
    text = render_families_speed(data, "families-speed")
    rows = _rows(text)
    assert rows["llama"] == ["llama", "74 K", "1.00 (8,000)", "2.00 (4,000)", "1.00x"]
    assert rows["gpt-oss"] == ["gpt-oss", "126 K (4 experts, top 2)", "—", "3.00 (2,667)", "1.50x"]
    assert rows["SmolLM2-135M"][1:] == ["106 M", "40.00 (200)", "50.00 (160)", "25.00x (1,432x the parameters)"]
    assert "8 sequences decoding (32-token prompts), median of 27 decode-only steps, 1 thread, float32" in text
    assert "gpt-oss's 0.60 ms of 3.00 ms a step, against 0.10 ms for Llama's dense MLPs" in text
    assert "would save 0.50 ms a step (at most 17 % of the step)" in text
    del result["llama"]                                           # no Llama: no ratios, no dense MLP
    rows = _rows(render_families_speed(data, "families-speed"))
    assert rows["gpt-oss"][4] == "—"


def test_the_published_speed_region_is_on_the_page():
    assert "families-speed" in report.REGION.findall(report.DOC.read_text())
    data = json.loads((report.RESULTS / "families-speed.json").read_text())
    assert data["provenance"]["commit"] and "llama" in data["result"]


def test_an_hf_cb_row_renders_with_the_engine_over_its_rate():
    """§1's offline tables carry HF continuous batching beside HF static (bench/renderers/engine_offline.py)."""
    from bench.renderers.engine_offline import render_offline

    def system(wall, agree=None):
        return {"wall_s": wall, "tok_per_s": 120 / wall, "agree_first16": agree, "peak_rss_mib": 1000.0}

    data = {"provenance": {"benchmark": "engine.offline", "command": "python -m bench.engine.offline", "commit": "abc1234",
                           "host": "h", "started": "2026-12-02T09:00:00Z", "finished": "2026-12-02T09:02:00Z"},
            "args": {"threads": 1, "dtype": "float32"},
            "workload": {"num_requests": 4, "prompt_tokens": 400, "prompt_len_range": [50, 150], "output_tokens": 120,
                         "output_len_range": [20, 40]},
            "systems": {"engine": system(10.0, 1.0), "hf-static": system(30.0), "hf-cb": system(25.0, 0.5)}}
    rows = _rows(render_offline(data, "offline-x"))
    assert rows["HF continuous batching"][1:5] == ["25.0 s", "4.8", "**2.50×**", "50 %"]
    assert rows["HF `generate`, static batches of 8"][3:5] == ["**3.00×**", "(reference)"]
