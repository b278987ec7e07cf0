"""docs/BENCHMARKS.md §5: in process against through the gateway, and the gateway with each
quota backend (`bench.serving.gateway_overhead`; a run with `--redis` and without the
in-process mode renders as the backends' table)."""

from __future__ import annotations

import statistics

from bench.renderers.common import caption, table

MODES = {"inprocess": "in-process `AsyncEngine`", "sse": "gateway, SSE", "ws": "gateway, WebSocket"}


def _s(ms) -> str:
    return "—" if ms is None else f"{ms / 1000:.2f} s"


def mode_label(mode: str) -> str:
    """'sse+redis' -> 'gateway, SSE, Redis quotas'."""
    base, _, redis = mode.partition("+")
    return MODES.get(base, base) + (", Redis quotas" if redis else "")


def _spread(xs: list[float]) -> str:
    return "—" if len(xs) < 2 else f"±{(max(xs) - min(xs)) / 2 / statistics.median(xs):.1%}"


def render_backends(data: dict, name: str) -> str:
    """Each gateway mode with the embedded quota backend and with Redis: every run's tokens/s,
    their median and spread, Redis's median against the embedded one's."""
    a, results = data["args"], data["results"]
    runs = data.get("runs") or {mode: [r] for mode, r in results.items()}
    tps = {mode: [r["tokens_per_s"] for r in rs] for mode, rs in runs.items()}
    arrivals = f"Poisson {a['rate']:g} req/s" if a["rate"] else "all at once"
    n = max(map(len, runs.values()))
    extra = (f"; {a['requests']} chat requests, {arrivals}, {max(1, a['max_tokens'] // 4)}–{a['max_tokens']} output "
             f"tokens each; {n} run{'s' * (n > 1)} of each mode in turn, a fresh server each; "
             f"TTFT and idle TTFT (median of {a['idle']} one-token requests) from each mode's median run")
    rows = []
    for mode, r in results.items():
        base = mode.partition("+")[0]
        med = statistics.median(tps[mode])
        vs = (f"**{med / statistics.median(tps[base]) - 1:+.1%}**" if mode != base and base in tps else "—")
        rows.append([mode_label(mode) + ("" if "+" in mode else ", embedded quotas"),
                     " / ".join(f"{x:.1f}" for x in tps[mode]), f"{med:.1f}", _spread(tps[mode]), vs,
                     f"{_s(r.get('ttft_p50_ms'))} / {_s(r.get('ttft_p99_ms'))}", f"{r['idle_ttft_p50_ms']:.1f} ms"])
    return "\n".join([caption(data, name, extra), "",
                      *table(["mode", "output tok/s, each run", "median", "spread", "vs embedded (medians)",
                              "TTFT p50 / p99 (trace)", "idle TTFT p50"], rows)])


def render_gateway_overhead(data: dict, name: str) -> str:
    a, results = data["args"], data["results"]
    if "inprocess" not in results and any(mode.endswith("+redis") for mode in results):
        return render_backends(data, name)
    first = next(iter(results))                 # the baseline: in process when it ran
    base = results[first]
    arrivals = f"Poisson {a['rate']:g} req/s" if a["rate"] else "all at once"
    extra = (f"; {a['requests']} chat requests, {arrivals}, {max(1, a['max_tokens'] // 4)}–{a['max_tokens']} "
             f"output tokens each, idle TTFT the median of {a['idle']} one-token requests")
    lines = [caption(data, name, extra), "",
             f"| mode | output tok/s | vs {mode_label(first)} | TTFT p50 / p99 (trace) | idle TTFT p50 | added |",
             "|---|---:|---:|---:|---:|---:|"]
    for mode, r in results.items():
        same = mode == first
        ratio = "—" if same else f"**{r['tokens_per_s'] / base['tokens_per_s'] - 1:+.1%}**"
        added = "—" if same else f"**{r['idle_ttft_p50_ms'] - base['idle_ttft_p50_ms']:+.1f} ms**"
        lines.append(f"| {mode_label(mode)} | {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{_s(r.get('ttft_p50_ms'))} / {_s(r.get('ttft_p99_ms'))} | {r['idle_ttft_p50_ms']:.1f} ms | "
                     f"{added} |")
    return "\n".join(lines)


RENDERERS = {"serving.gateway_overhead": render_gateway_overhead}
