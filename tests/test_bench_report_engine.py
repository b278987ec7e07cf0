"""The engine wing's renderers (docs/BENCHMARKS.md §1, §2, §7–§10): each table is computed from
its JSON (synthetic here, so every expected number is derived from the input), a fraction of the
roofline is printed only against the run's own host, and a real (tiny) benchmark run writes a
JSON that renders."""

from __future__ import annotations

import copy
import json

import pytest

from bench import report
from bench.engine.roofline import Rates, Shapes, decode_step_s, prefill_s
from bench.renderers.engine_common import offline_bound_s, same_host_roofline
from bench.renderers.engine_grammar import render_grammar
from bench.renderers.engine_kernels import render_attention, render_gemm
from bench.renderers.engine_offline import render_offline
from bench.renderers.engine_roofline import render_roofline
from bench.renderers.engine_scheduling import render_smoothness
from bench.renderers.engine_tp import render_tp

PROV = {"command": "python -m bench.engine.x", "commit": "abc1234", "dirty": False, "host": "hostA",
        "cpu": "Some CPU, family 1 model 2", "isa": "avx2", "started": "2026-12-02T01:00:00Z",
        "finished": "2026-12-02T01:05:00Z", "loadavg_start": 1.0, "loadavg_end": 2.0}
SHAPES = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 1000}
ROOF = {"source": "r.json", "provenance": {**PROV, "command": "python -m bench.engine.roofline"}, "threads": 2,
        "shapes": SHAPES, "matmul_flops": {"bfloat16": {"1": 1e9, "512": 4e9}, "float32": {"512": 2e9}},
        "read_bandwidth": 1e9}


def _cells(md: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is FIRST."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in\n{md}")


def _offline(roofline=None, host="hostA") -> dict:
    return {"provenance": {**PROV, "benchmark": "engine.offline", "host": host}, "args": {"threads": 2},
            "env": {"threads": 2}, "roofline": roofline,
            "workload": {"num_requests": 4, "prompt_tokens": 400, "output_tokens": 120,
                         "prompt_len_range": [50, 150], "output_len_range": [20, 40]},
            "systems": {"engine": {"dtype": "bfloat16", "wall_s": 3.0, "tok_per_s": 40.0, "agree_first16": 0.75,
                                   "peak_rss_mib": 900.0, "num_steps": 50, "overhead": 0.012, "max_running": 4,
                                   "kv_waste_at_peak": 0.0125},
                        "hf-static": {"wall_s": 12.0, "tok_per_s": 10.0, "agree_first16": 1.0, "peak_rss_mib": 800.0}}}


def test_offline_ratio_agreement_and_the_fraction_of_a_same_host_bound():
    md = render_offline(_offline(ROOF), "offline-x")
    shapes, rates = Shapes(**SHAPES), Rates(flops=4e9, bandwidth=1e9)
    bound = offline_bound_s(shapes, rates, "bfloat16", 400, 120, 4, 50)
    # the bound is the longer of the FLOPs at the peak and 50 steps each reading every weight once
    assert bound == max(prefill_s(shapes, rates, 400, 4) + 120 * 2 * shapes.linear_params / 4e9,
                        50 * shapes.linear_params * 2 / 1e9)
    engine, hf = _cells(md, "streamgate engine"), _cells(md, "HF `generate`, static batches of 8")
    assert engine[1:3] == ["3.0 s", "40.0"] and engine[4] == "75 %" and engine[6] == f"{100 * bound / 3.0:.0f} %"
    assert hf[3] == "**4.00×**" and hf[4] == "(reference)" and hf[6] == "—"
    assert "Bound from the roofline of the same host and threads" in md and "peak bf16 4 / fp32 2 GFLOP/s, read 1.0 GB/s" in md
    assert "50 steps" in md and "1.2%" in md and "1.25%" in md


@pytest.mark.parametrize("host, roof", [("hostB", ROOF), ("hostA", None), (None, ROOF)])
def test_no_fraction_against_another_hosts_roofline_or_none(host, roof):
    data = _offline(roof, host)
    assert same_host_roofline(data) is None
    md = render_offline(data, "offline-x")
    assert _cells(md, "streamgate engine")[6] == "—" and "No fraction of the roofline" in md
    other_cpu = _offline(copy.deepcopy(ROOF))
    other_cpu["roofline"]["provenance"]["cpu"] = "Another CPU"
    assert same_host_roofline(other_cpu) is None
    one_thread = _offline(ROOF)
    one_thread["env"]["threads"] = 1                       # a 2-thread roofline is no bound for a 1-thread run
    assert same_host_roofline(one_thread) is None and "measured on 2 threads, the run on 1" in render_offline(one_thread, "o")


def test_smoothness_ratio_and_target_verdict():
    data = {"provenance": {**PROV, "benchmark": "engine.scheduling"}, "dtype": "float32",
            "args": {"mode": "smoothness", "streams": 16, "long_prompts": 4, "long_tokens": 2000, "arrival_every": 6},
            "result": {"chunked, fixed 256": {"budget": 256, "itl_p50_ms": 100.0, "itl_p99_ms": 190.0,
                                              "itl_max_ms": 250.0, "itl_samples": 320, "long_prompt_ttft_s_median": 2.5},
                       "chunked, target 9 ms": {"budget": 256, "itl_p50_ms": 100.0, "itl_p99_ms": 230.0,
                                                "itl_max_ms": 300.0, "itl_samples": 300, "long_prompt_ttft_s_median": 2.0},
                       "prefill-first unchunked": {"budget": 2064, "itl_p50_ms": 20.0, "itl_p99_ms": 1000.0,
                                                   "itl_max_ms": None, "itl_samples": None,
                                                   "long_prompt_ttft_s_median": None}}}
    md = render_smoothness(data, "s")
    assert report.renderer_for(data) is render_smoothness
    assert _cells(md, "chunked, fixed 256")[4:] == ["**1.90** (met)", "250 ms", "2.50 s", "320"]
    assert _cells(md, "chunked, target 9 ms")[4] == "**2.30** (missed)"
    assert _cells(md, "prefill-first unchunked")[4:] == ["50.00", "—", "—", "—"]


def test_tp_decode_relative_to_the_first_row():
    args = {"model": None, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "layers": 2, "vocab": 1024,
            "dtype": "float32", "device": "cpu", "batch": 8, "prompt": 64, "new": 16}
    row = {"prefill_step_ms": 100.0, "broadcast_share": 0.0, "comm_share_profiled": 0.0, "ping_p50_ms": 0.0}
    data = {"provenance": {**PROV, "benchmark": "engine.tp"}, "args": args,
            "rows": [{**row, "tp": 1, "threads": 1, "decode_step_ms": 300.0},
                     {**row, "tp": 2, "threads": 2, "decode_step_ms": 240.0, "broadcast_share": 0.013,
                      "comm_share_profiled": 0.11, "ping_p50_ms": 1.36}]}
    md = render_tp(data, "tp")
    assert _cells(md, "2")[1:] == ["2", "100 ms", "240 ms", "0.80×", "1.3 %", "11.0 %", "1.36 ms"]
    assert _cells(md, "1")[4] == "1.00×" and _cells(md, "1")[7] == "—"


def test_attention_and_gemm_speed_ups():
    att = {"provenance": {**PROV, "benchmark": "engine.attention"}, "dtype": "bfloat16", "threads": 2, "reps": 5,
           "rows": [{"seqs": 4, "min_ctx": 600, "max_ctx": 600, "chunk": 128, "torch_ms": 50.0, "kernel_ms": 40.0},
                    {"seqs": 32, "min_ctx": 200, "max_ctx": 1000, "chunk": 1, "torch_ms": 30.0, "kernel_ms": 60.0}]}
    md = render_attention(att, "a")
    assert "| 4 × 128-token chunks over 600 (`4x600-600/128`) | 50.0 ms | 40.0 ms | 1.25× |" in md
    assert "| 32 decode rows over 200–1,000 tokens (`32x200-1000/1`) | 30.0 ms | 60.0 ms | 0.50× |" in md
    assert "no AMX" not in md
    amx = {**att, "amx": True, "rows": [{**att["rows"][0], "kernel_no_amx_ms": 100.0},
                                        {**att["rows"][1], "kernel_no_amx_ms": 61.0}]}
    md = render_attention(amx, "a")
    assert "| 4 × 128-token chunks over 600 (`4x600-600/128`) | 50.0 ms | 40.0 ms | 1.25× | 100.0 ms | 2.50× |" in md
    assert "(`32x200-1000/1`) | 30.0 ms | 60.0 ms | 0.50× | 61.0 ms | — |" in md      # decode: no tiles
    walk = {**att, "rows": [att["rows"][0], {**att["rows"][1], "span_loads": True, "kernel_other_walk_ms": 90.0}]}
    md = render_attention(walk, "a")                     # decode rows: loads, and prefetches beside them
    assert "| kernel, next span prefetched | loads speed-up |" in md
    assert "(`32x200-1000/1`) | 30.0 ms | 60.0 ms | 0.50× | 90.0 ms | 1.50× |" in md
    assert "(`4x600-600/128`) | 50.0 ms | 40.0 ms | 1.25× | — | — |" in md
    parts = {**walk, "rows": [walk["rows"][0], {**walk["rows"][1], "kernel_one_part_ms": 120.0}]}
    md = render_attention(parts, "a")                    # decode rows in parts, and whole beside them
    assert "| kernel, rows in one part | parts speed-up |" in md
    assert "(`32x200-1000/1`) | 30.0 ms | 60.0 ms | 0.50× | 90.0 ms | 1.50× | 120.0 ms | 2.00× |" in md
    assert "(`4x600-600/128`) | 50.0 ms | 40.0 ms | 1.25× | — | — | — | — |" in md
    gemm = {"provenance": {**PROV, "benchmark": "engine.gemm"}, "args": {"reps": 50}, "threads": 2,
            "native_bf16": True, "kernel": True,
            "rows": [{"layer": "o", "out": 500, "in": 1000, "rows": 8, "kernel_fp32_ms": 0.4, "mkl_fp32_ms": 0.5,
                      "torch_bf16_ms": 0.2, "onednn_bf16_ms": 0.1},
                     {"layer": "o", "out": 500, "in": 1000, "rows": 1, "kernel_fp32_ms": None, "mkl_fp32_ms": 0.5,
                      "torch_bf16_ms": 0.3, "onednn_bf16_ms": 0.4}]}
    md = render_gemm(gemm, "g")
    # best bf16 / best fp32 and the best bf16's GFLOP/s (2 x rows x in x out / time)
    assert "| o 1,000→500 | 8 | 0.400 | 0.500 | 0.200 | 0.100 | 0.25× | 80 |" in md
    assert "|  | 1 | — | 0.500 | 0.300 | 0.400 | 0.60× | 3 |" in md


def test_grammar_tables_and_decode_step_fraction():
    data = {"provenance": {**PROV, "benchmark": "engine.grammar"}, "dtype": "bfloat16", "roofline": ROOF,
            "args": {"steps": 40, "rounds": 2}, "tokenizer_build_ms": 1012.0,
            "compile": {"small": {"bytes": 181, "check_ms": 0.7, "compile_ms": [0.5, 0.4, 0.4]},
                        "large": {"bytes": 9800, "check_ms": 12.0, "compile_ms": [20.0, 8.0, 7.5]}},
            "sampling": {"rows": 32, "reps": 50, "vocab": 1000,
                         "by_constrained": {"0": {"mask_ms": 0.01, "with_sampling_ms": 16.0},
                                            "32": {"mask_ms": 1.5, "with_sampling_ms": 24.0}}},
            "decode": [{"streams": 8, "constrained": 0, "step_ms": 40.0, "forward_ms": 35.0, "rounds_ms": [41.0, 39.0]},
                       {"streams": 8, "constrained": 8, "step_ms": 42.0, "forward_ms": 35.5, "rounds_ms": [43.0, 41.0]}]}
    md = render_grammar(data, "grammar")
    assert "| token-level compile, large schema, 3 runs | 20.00 ms / 8.00 ms / 7.50 ms |" in md
    assert "all 32 rows constrained" in md and "| 1.50 ms / 24.00 ms |" in md and "| 10 µs / 16.00 ms |" in md
    bound = 1e3 * decode_step_s(Shapes(**SHAPES), Rates(flops=4e9, bandwidth=1e9), 8, 2, 128, 2)
    assert _cells(md, "8")[1:] == ["0", "40.00 ms [41.00, 39.00]", "35.00 ms", "—", f"{100 * bound / 40:.0f} %"]
    assert _cells(md, "8")[1] == "0"
    assert f"| 8 | 8 | 42.00 ms [43.00, 41.00] | 35.50 ms | +5.0 % | {100 * bound / 42:.0f} % |" in md


def test_roofline_table_from_its_measurements():
    data = {"provenance": {**PROV, "benchmark": "engine.roofline"}, "dtype": "bfloat16", "threads": 2, "reps": 20,
            "onednn": {"verbose_isa": "AVX-512"}, "read_bandwidth": 12.34e9,
            "matmul_flops": {"bfloat16": {"1": 25e9, "512": 176e9}, "float32": {"512": 57e9}},
            "bounds": {"decode_step_ms": {"1": 25.93, "32": 48.9}, "prefill_chunk_ms": 669.4, "prefill_chunk_tokens": 512,
                       "serving_tok_s": {"1": 31.2, "8": 104.4}},
            "workload": {"prompt_tokens": 286, "output_tokens": 64},
            "measured_tok_s": {"8": 52.2}, "fraction_of_bound": {"8": 0.5}}
    md = render_roofline(data, "roofline")
    assert "| bf16 matmul at 1 / 512 rows (best of F.linear and oneDNN prepacked) | 25 / 176 GFLOP/s |" in md
    assert "| memory read bandwidth | 12.3 GB/s |" in md and "| bound: a decode step of 1 / 32 rows | 25.9 / 48.9 ms |" in md
    assert "at 1 / 8 streams | 31 / 104 output tok/s |" in md and "| 52.2 tok/s = 50 % of the bound |" in md


def test_a_real_gemm_run_writes_json_that_renders(tmp_path):
    """bench.engine.gemm, one row count, a few calls: its JSON names its run and renders one row per layer."""
    from bench.engine import gemm

    out = tmp_path / "gemm.json"
    assert gemm.main(["--rows", "1", "--reps", "3", "--threads", "1", "--json-out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["provenance"]["benchmark"] == "engine.gemm" and data["provenance"]["finished"]
    assert report.renderer_for(data) is render_gemm
    md = render_gemm(data, "gemm")
    assert [r["layer"] for r in data["rows"]] == [name for _, _, name in gemm.SHAPES]
    for r in data["rows"]:
        label = f"{r['layer']} {r['in']:,}→{r['out']:,}"
        assert _cells(md, label)[4] == f"{r['torch_bf16_ms']:.3f}"
