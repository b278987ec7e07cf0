"""docs/BENCHMARKS.md §3: one tenant's TTFT under load against alone, pooled over seeds
(`bench.serving.pooled`)."""

from __future__ import annotations

from bench.renderers.common import caption

QS = (50, 90, 99)


def _cell(row: dict, q: int, alone: bool) -> str:
    s, x = row.get(f"p{q}_s"), row.get(f"p{q}_x")
    if s is None:
        return "—"
    return f"{s:.2f} s" if alone or x is None else f"{s:.2f} s ({x:.2f}×)"


def _num(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def render_pooled(data: dict, name: str) -> str:
    a, rows = data["args"], data["summary"]
    seeds = a["seeds"]
    extra = f"; workload `{data.get('workload', a['workload'])}`, seeds {seeds}, driver {a.get('driver', '?')}"
    lines = [caption(data, name, extra), "",
             f"| {a['tenant']} TTFT, pooled | requests | p50 (× alone) | p90 | p99 | out tok/s | preemptions / request "
             "| per-seed p99 × alone |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(rows):
        per_seed = " ".join(f"{x:.2f}" for x in r.get("per_seed_p99_x") or []) or "—"
        lines.append(f"| {r['system']} | {_num(r.get('requests'), ',')} | "
                     + " | ".join(_cell(r, q, i == 0) for q in QS)
                     + f" | {_num(r.get('output_tps'), '.1f')} | {_num(r.get('preemptions_per_request'), '.2f')} | "
                     f"{'—' if i == 0 else per_seed} |")
    return "\n".join(lines)


RENDERERS = {"serving.pooled": render_pooled}
