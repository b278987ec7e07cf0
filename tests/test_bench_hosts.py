"""bench/engine/hosts.py: each played host runs in a process that the engine, the kernels and
oneDNN see as that host (the dtype "auto" would pick, the kernel variant), end to end on a tiny
model; and the renderer's ratios against the AMX (unchanged) row."""

from __future__ import annotations

import json

from bench.engine.hosts import main
from bench.renderers.hosts import render_hosts
from engine.dtypes import cpu_flags


def test_an_avx2_host_is_played_with_its_variant_and_without_native_bf16(tiny_model, tmp_path):
    out = tmp_path / "hosts.json"
    assert main(["--hosts", "amx,avx2", "--dtypes", "float32", "--model", tiny_model(), "--rows", "1,2", "--ctx", "24",
                 "--steps", "2", "--prefill-reps", "1", "--json-out", str(out)]) == 0
    data = json.loads(out.read_text())
    here, avx2 = data["results"]
    assert here["host"] == "amx" and avx2["host"] == "avx2"
    assert avx2["variant"] == "avx2" and avx2["native_bf16"] is False
    assert here["native_bf16"] == ("avx512_bf16" in cpu_flags() or {"amx_bf16", "amx_tile"} <= cpu_flags())
    assert all(r["prefill_ms"] > 0 and set(r["decode_ms"]) == {"1", "2"} for r in data["results"])
    text = render_hosts(data, "hosts")
    ratio = avx2["prefill_ms"] / here["prefill_ms"]
    assert f"| avx2 | float32 | avx2 | {avx2['prefill_ms']:.0f} ms |" in text and f"{ratio:.2f}× / " in text
