"""The renderer of `bench.engine.gemm --crossover` (docs/BENCHMARKS.md §10): one line per row
count, one cell per layer with oneDNN's time over the block kernel's and the kernel's GFLOP/s."""

from __future__ import annotations

from bench.renderers.engine_kernels import render_gemm


def run(rows):
    return {"provenance": {"benchmark": "engine.gemm", "command": "python -m bench.engine.gemm --crossover",
                           "commit": "abc1234", "host": "vm", "started": "2026-12-02T07:00:00Z",
                           "finished": "2026-12-02T07:01:00Z"},
            "args": {"crossover": True, "reps": 9}, "threads": 2, "variant": "avx512_bf16", "rows": rows}


def test_each_row_count_is_a_line_and_each_layer_a_cell():
    rows = [{"layer": "o", "out": 576, "in": 576, "rows": m, "block_bf16_ms": b, "onednn_bf16_ms": o}
            for m, b, o in ((1, 0.01, 0.02), (8, 0.05, 0.04))]
    rows.append({"layer": "down", "out": 576, "in": 1536, "rows": 1, "block_bf16_ms": 0.02, "onednn_bf16_ms": 0.05})
    text = render_gemm(run(rows), "gemm-crossover")
    lines = text.splitlines()
    assert lines[2] == "| rows | o 576→576 | down 1,536→576 |"
    gf = 2 * 1 * 576 * 576 / 0.01e-3 / 1e9                       # 66 GFLOP/s
    assert lines[4] == f"| 1 | 2.00× ({gf:,.0f}) | 2.50× ({2 * 1536 * 576 / 0.02e-3 / 1e9:,.0f}) |"
    assert lines[5] == f"| 8 | 0.80× ({2 * 8 * 576 * 576 / 0.05e-3 / 1e9:,.0f}) | — |"     # down not run at 8 rows
    assert "the avx512_bf16 build" in lines[0] and "2 threads" in lines[0]
