"""docs/BENCHMARKS.md §10's int8 table is rendered from `bench.engine.int8`'s JSON: a synthetic run's
numbers come out derived as the caption and table say (ratios, MB, percentages, the target's
verdict), and the report finds the renderer by the run's benchmark name."""

from __future__ import annotations

from bench import report
from bench.renderers import RENDERERS
from bench.renderers.int8 import render_int8


def _run(bf16_step: float, int8_step: float) -> dict:
    return {
        "provenance": {"benchmark": "engine.int8", "command": "python -m bench.engine.int8", "commit": "abc1234",
                       "dirty": False, "host": "h", "cpu": "CPU X", "isa": "avx2", "started": "2026-12-02T03:00:00Z",
                       "finished": "2026-12-02T03:05:00Z", "loadavg_start": 2.0, "loadavg_end": 3.0},
        "args": {"threads": 2, "steps": 40, "ctx": 256, "window": 512, "prefill_reps": 3, "ppl_tokens": 4096,
                 "agree_tokens": 64},
        "kernels": "avx2",
        "decode": {"median_s": {"bfloat16": bf16_step, "int8": int8_step}, "paired_speedup": 1.75},
        "prefill": {"median_s": {"bfloat16": 0.800, "int8": 0.840}},
        "weight_bytes": {"bf16": 269_000_000, "int8": 135_500_000, "scratch": 8_388_608},
        "perplexity": {"float32": 70.72, "bfloat16": 70.81, "int8": 71.52},
        "agreement": {"int8": {"prefix": 0.5, "positions": 0.625}, "float32": {"prefix": 0.75, "positions": 0.8}},
        "agree_prompts": 6,
        "loadavg_range": [1.5, 4.5],
    }


def test_int8_table_derives_its_numbers_from_the_run():
    text = render_int8(_run(0.0250, 0.0125), "int8")
    assert "| 25.0 ms | 12.5 ms | **2.00× faster** (per-round pairs: 1.75×; target 1.6×: met) |" in text
    assert "| 800 ms | 840 ms | 1.05× the time |" in text
    assert "| 269.0 MB | 135.5 MB + 8.4 MB scratch | 0.53× the bytes |" in text
    assert "(fp32: 70.72) | 70.81 | 71.52 | +1.0 % |" in text
    assert "| fp32: 75.0 % (80.0 %) | 50.0 % (62.5 %) |" in text
    assert "avx2 kernels, 2 threads, 40 alternating" in text and "load average 1.5–4.5" in text
    assert "commit `abc1234`" in text and "[docs/bench/results/int8.json]" in text


def test_a_slower_int8_says_the_target_is_not_met():
    text = render_int8(_run(0.0250, 0.0200), "int8")
    assert "**1.25× faster**" in text and "target 1.6×: not met" in text


def test_the_report_finds_the_int8_renderer():
    assert RENDERERS["engine.int8"] is render_int8
    assert report.renderer_for(_run(0.02, 0.01)) is render_int8
