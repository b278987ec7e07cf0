"""docs/BENCHMARKS.md §10: the engine's steps as lesser hosts run them (`bench.engine.hosts`)."""

from __future__ import annotations

from bench.renderers.common import caption


def render_hosts(data: dict, name: str) -> str:
    results = data["results"]
    rows = sorted({int(n) for r in results for n in r["decode_ms"]})
    amx = {r["dtype"]: r for r in results if r["host"] == "amx"}
    a = data.get("args") or {}
    what = (f"; a {a['ctx']}-token prompt's prefill step (median of {a['prefill_reps']}), decode steps over "
            f"{a['ctx']}-token prompts (median of {a['steps']})" if a else "")
    lines = [caption(data, name, what + "; each row in its own process, playing the host with "
                     "STREAMGATE_HIDE_CPU_FLAGS, STREAMGATE_KERNEL_ISA, STREAMGATE_AMX=0 and ONEDNN_MAX_CPU_ISA "
                     "on this CPU"), "",
             "| host played | dtype | kernel variant | prefill step | "
             + " | ".join(f"decode step, {n} row{'s' if n > 1 else ''}" for n in rows) + " | × the AMX host's time, prefill / decode |",
             "|---|---|---|---:|" + "---:|" * len(rows) + "---|"]
    for r in results:
        ref = amx.get(r["dtype"])
        times = [r["decode_ms"][str(n)] for n in rows]                      # JSON keys: strings
        if ref is not None and r is not ref:
            ratio = f"{r['prefill_ms'] / ref['prefill_ms']:.2f}× / " + " ".join(
                f"{t / ref['decode_ms'][str(n)]:.2f}×" for n, t in zip(rows, times))
        else:
            ratio = "—"
        lines.append(f"| {r['host']} | {r['dtype']} | {r['variant']} | {r['prefill_ms']:.0f} ms | "
                     + " | ".join(f"{t:.1f} ms" for t in times) + f" | {ratio} |")
    return "\n".join(lines)


RENDERERS = {"engine.hosts": render_hosts}
