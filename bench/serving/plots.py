"""PNG plots for the serving benchmark (matplotlib, Agg backend). Each function takes runs
as `bench/serving/serve.py` builds them ({label, rate, summary, requests, stats}) and writes one file."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

from bench.serving.servestats import request_metrics  # noqa: E402


def _plain_log(axis) -> None:
    """A log axis labelled 20, 50, 100 rather than 2x10^1."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_cdfs(runs: list[dict], path: Path) -> Path:
    """CDFs of TTFT, ITL and e2e latency, one line per run."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        ms = [request_metrics(r) for r in run["requests"]]
        series = {"TTFT": [m["ttft"] for m in ms], "ITL": [g for m in ms for _, g, _ in m["gaps"]],
                  "e2e latency": [m["e2e"] for m in ms]}
        for ax, (name, xs) in zip(axes, series.items()):
            xs = sorted(x * 1000 for x in xs if x is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=run["label"])
    for ax, name in zip(axes, ("TTFT", "ITL", "e2e latency")):
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_xscale("log")
        _plain_log(ax.xaxis)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return _save(fig, path)


def itl_over_time(run: dict, path: Path) -> Path:
    """Every inter-token gap at the time it ended; long-prompt arrivals as vertical lines."""
    fig, ax = plt.subplots(figsize=(11, 4.2))
    pts = [(t, g * 1000) for r in run["requests"] if not r["long"] for t, g, _ in request_metrics(r)["gaps"]]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, alpha=0.5, label="gap (short requests)")
    longs = [r for r in run["requests"] if r["long"] and r["send"] is not None]
    for i, r in enumerate(longs):
        ax.axvline(r["send"], color="tab:red", lw=0.8, alpha=0.7, label="long prompt arrives" if i == 0 else None)
        if r["deltas"]:
            ax.axvspan(r["send"], r["deltas"][0][0], color="tab:red", alpha=0.06,
                       label="until its first token" if i == 0 else None)
    ax.set(title=f"Inter-token latency over time ({run['label']})", xlabel="time since start (s)",
           ylabel="ITL (ms)")
    if pts:
        ax.set_yscale("log")
        _plain_log(ax.yaxis)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    return _save(fig, path)


def rate_sweep(runs: list[dict], path: Path, ttft_line_s: float = 2.0) -> Path:
    """Throughput and TTFT p99 against the offered request rate, one line per preset."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for preset in dict.fromkeys(r["preset"] for r in runs):
        mine = sorted((r for r in runs if r["preset"] == preset), key=lambda r: r["rate"])
        rates = [r["rate"] for r in mine]
        left.plot(rates, [r["summary"]["output_tps"] for r in mine], "o-", label=f"{preset} output tok/s")
        p99 = [r["summary"]["ttft_ms"]["p99"] for r in mine]
        right.plot(rates, [None if v is None else v / 1000 for v in p99], "o-", label=preset)
    right.axhline(ttft_line_s, color="tab:red", ls="--", lw=1, label=f"{ttft_line_s:g} s")
    left.set(title="Throughput vs offered rate", xlabel="offered rate (req/s)", ylabel="output tokens/s")
    right.set(title="TTFT p99 vs offered rate", xlabel="offered rate (req/s)", ylabel="TTFT p99 (s)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def tenant_tokens(run: dict, path: Path) -> Path:
    """Cumulative output tokens per tenant over time."""
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for tenant in sorted({r["tenant"] for r in run["requests"]}):
        events = []
        for r in run["requests"]:
            if r["tenant"] != tenant or not r["deltas"]:
                continue
            counts = [n for _, n in r["deltas"]]
            counts[-1] += max(0, (r["output_tokens"] or 0) - sum(counts))     # merged deltas on the wire
            events += [(t, n) for (t, _), n in zip(r["deltas"], counts)]
        events.sort()
        total, xs, ys = 0, [0.0], [0]
        for t, n in events:
            total += n
            xs.append(t)
            ys.append(total)
        ax.step(xs, ys, where="post", label=tenant)
    ax.set(title=f"Output tokens per tenant ({run['label']})", xlabel="time since start (s)",
           ylabel="cumulative output tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
