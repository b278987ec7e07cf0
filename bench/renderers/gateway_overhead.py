"""docs/BENCHMARKS.md §5: in process against through the gateway
(`bench.serving.gateway_overhead`)."""

from __future__ import annotations

from bench.renderers.common import caption

MODES = {"inprocess": "in-process `AsyncEngine`", "sse": "gateway, SSE", "ws": "gateway, WebSocket"}


def _s(ms) -> str:
    return "—" if ms is None else f"{ms / 1000:.2f} s"


def mode_label(mode: str) -> str:
    """'sse+redis' -> 'gateway, SSE, Redis quotas'."""
    base, _, redis = mode.partition("+")
    return MODES.get(base, base) + (", Redis quotas" if redis else "")


def render_gateway_overhead(data: dict, name: str) -> str:
    a, results = data["args"], data["results"]
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
