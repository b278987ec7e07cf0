"""docs/BENCHMARKS.md §10's int8 KV cache table is rendered from `bench.engine.kv_int8`'s JSON: a
synthetic run's numbers come out derived as the table says, and the report finds the renderer
by the run's benchmark name."""

from __future__ import annotations

from bench import report
from bench.renderers import RENDERERS
from bench.renderers.kv_int8 import render_kv_int8


def _run() -> dict:
    return {
        "provenance": {"benchmark": "engine.kv_int8", "command": "python -m bench.engine.kv_int8", "commit": "abc1234",
                       "dirty": False, "host": "h", "cpu": "CPU X", "isa": "avx2", "started": "2026-12-05T03:00:00Z",
                       "finished": "2026-12-05T03:05:00Z", "loadavg_start": 2.0, "loadavg_end": 3.0},
        "args": {"dtype": "bfloat16", "steps": 30, "ctx": 320, "window": 512, "ppl_tokens": 4096, "agree_tokens": 64},
        "kernels": "avx512_bf16",
        "block_bytes": {"dtype": 368640, "int8": 195840},
        "decode": {"1": {"median_s": {"dtype": 0.0172, "int8": 0.0166}},
                   "32": {"median_s": {"dtype": 0.0430, "int8": 0.0344}}},
        "perplexity": {"float32": 69.78, "dtype": 69.85, "int8": 70.55},
        "agreement": {"int8": {"prefix": 0.5, "positions": 0.625}, "float32": {"prefix": 0.75, "positions": 0.8}},
        "agree_prompts": 6,
        "loadavg_range": [1.5, 4.5],
    }


def test_kv_int8_table_derives_its_numbers_from_the_run():
    text = render_kv_int8(_run(), "kv-int8")
    assert "| 1-row decode step, median | 17.2 ms | 16.6 ms | **1.04× faster** |" in text
    assert "| 32-row decode step, median | 43.0 ms | 34.4 ms | **1.25× faster** |" in text
    assert "| 368.6 kB | 195.8 kB | 1.88× the tokens a GiB |" in text
    assert "(fp32: 69.78) | 69.85 | 70.55 | +1.0 % |" in text
    assert "| fp32 model: 75.0 % (80.0 %) | 50.0 % (62.5 %) |" in text
    assert "avx512_bf16 kernels, bfloat16 model, 30 alternating" in text and "load average 1.5–4.5" in text
    assert "commit `abc1234`" in text and "[docs/bench/results/kv-int8.json]" in text


def test_the_report_finds_the_kv_int8_renderer():
    assert RENDERERS["engine.kv_int8"] is render_kv_int8
    assert report.renderer_for(_run()) is render_kv_int8


def test_the_benchmark_runs_and_its_json_renders(tiny_model, tmp_path):
    """A real run on a tiny model (fp32, 2 rows, a few steps) writes a JSON the table renders:
    both engines decoded, the int8 block is (16 + 4) / (4 * 16) of the fp32 one (head_dim 16)."""
    import json

    from bench.engine.kv_int8 import main

    out = tmp_path / "kv.json"
    assert main(["--model", tiny_model("llama"), "--dtype", "float32", "--rows", "1,2", "--ctx", "40", "--steps", "3",
                 "--ppl-tokens", "300", "--window", "128", "--agree-tokens", "6", "--json-out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["decode"]) == {"1", "2"} and all(len(r["times_s"]["int8"]) == 3 for r in data["decode"].values())
    assert data["block_bytes"]["int8"] * 64 == data["block_bytes"]["dtype"] * 20
    assert 0.0 <= data["agreement"]["int8"]["prefix"] <= 1.0
    assert "| 2-row decode step, median |" in render_kv_int8(data, "kv")
