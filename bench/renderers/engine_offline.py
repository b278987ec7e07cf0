"""docs/BENCHMARKS.md §1: engine throughput against Hugging Face (`bench.engine.offline`)."""

from __future__ import annotations

from bench.renderers.common import caption
from bench.renderers.engine_common import offline_bound_s, pct, rates, roofline_note

NAMES = {"engine": "streamgate engine", "hf-static": "HF `generate`, static batches of 8",
         "hf-cb": "HF continuous batching"}


def _f(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def render_offline(data: dict, name: str) -> str:
    w, systems, a = data["workload"], data["systems"], data.get("args") or {}
    engine = systems.get("engine") or {}
    dtype = engine.get("dtype") or a.get("dtype", "?")
    threads = (data.get("env") or {}).get("threads", a.get("threads"))
    extra = (f"; {w['num_requests']} requests, {w['prompt_tokens']:,} prompt tokens "
             f"({w['prompt_len_range'][0]:,}–{w['prompt_len_range'][1]:,} each), {w['output_tokens']:,} output tokens "
             f"({w['output_len_range'][0]}–{w['output_len_range'][1]}), greedy, EOS ignored; {dtype}, "
             f"{threads} thread{'s' if threads != 1 else ''}.{roofline_note(data)}")
    bound = None
    if (sr := rates(data, dtype)) and engine.get("num_steps"):
        bound = offline_bound_s(*sr, dtype, w["prompt_tokens"], w["output_tokens"], w["num_requests"],
                                engine["num_steps"])
    tps = {s: r.get("tok_per_s") for s, r in systems.items()}
    ref = next((s for s in ("hf-static", "hf-cb", "engine") if "error" not in systems.get(s, {"error": 1})), None)
    lines = [caption(data, name, extra), "",
             "| system | wall | output tok/s | engine / this | agree on first 16 tokens | peak RSS | % of the bound |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s, r in systems.items():
        if "error" in r:
            lines.append(f"| {NAMES.get(s, s)} | failed: {r['error']} | | | | | |")
            continue
        ratio = "—" if s == "engine" or not tps.get("engine") else f"**{tps['engine'] / r['tok_per_s']:.2f}×**"
        lines.append(f"| {NAMES.get(s, s)} | {r['wall_s']:.1f} s | {r['tok_per_s']:.1f} | {ratio} | "
                     f"{'(reference)' if s == ref else _f(r.get('agree_first16'), '.0%').replace('%', ' %')} | "
                     f"{_f(r.get('peak_rss_mib'), ',.0f')}{' MiB' if r.get('peak_rss_mib') else ''} | {pct(bound, r['wall_s']) if s == 'engine' else '—'} |")
    if "overhead" in engine:
        lines += ["", f"Engine: {engine['num_steps']:,} steps, at most {engine.get('max_running')} sequences running; "
                  f"step time outside the forward {_f(engine.get('overhead'), '.1%')} "
                  f"(target ≤ 10 %), KV waste at peak {_f(engine.get('kv_waste_at_peak'), '.2%')} (target < 4 %)."]
    return "\n".join(lines)


RENDERERS = {"engine.offline": render_offline}
