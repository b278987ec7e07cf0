"""Statistics for the serving benchmark: pure functions of request records and stats
samples (no I/O, no clocks). Records are `replay.new_record` dicts with times in seconds
from the run's start; latencies in summaries are milliseconds.

    TTFT  = first delta - send                 e2e  = end - send
    ITL   = gap between consecutive deltas     TPOT = (e2e - TTFT) / (n - 1), n > 1 tokens
    goodput = requests that succeeded with TTFT <= slo.ttft and TPOT <= slo.tpot (a
              1-token answer has no TPOT and meets that half), per second of makespan

A delta may carry several tokens (the client lagged, or text was held back at a word
boundary): its gap is counted once; `merged_tokens` says how many tokens came that way.
"""

from __future__ import annotations

import math
from collections import Counter

from bench.serving.weighted import describe

QUANTILES = (50, 90, 99)


def percentile(xs, q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(xs, scale: float = 1000.0) -> dict:
    """p50/p90/p99/max/mean/count of `xs` (seconds) times `scale` (default: milliseconds)."""
    xs = [x * scale for x in xs if x is not None]
    out = {f"p{q}": percentile(xs, q) for q in QUANTILES}
    out.update(max=max(xs) if xs else None, mean=sum(xs) / len(xs) if xs else None, count=len(xs))
    return out


def tpot(e2e: float | None, ttft: float | None, n: int) -> float | None:
    """Time per output token after the first; None when there is no second token."""
    if e2e is None or ttft is None or n < 2:
        return None
    return (e2e - ttft) / (n - 1)


def output_tokens(rec: dict) -> int:
    """Tokens the request produced: the server's usage count, else the deltas' counts."""
    n = rec.get("output_tokens")
    return n if n is not None else sum(k for _, k in rec["deltas"])


def request_metrics(rec: dict) -> dict:
    """One request's TTFT, e2e, TPOT, queue time (seconds), ITL gaps and outcome."""
    send, deltas = rec["send"], rec["deltas"]
    ok = rec["error"] is None and rec["end"] is not None
    ttft = deltas[0][0] - send if deltas and send is not None else None
    e2e = rec["end"] - send if ok and send is not None else None
    n = output_tokens(rec)
    gaps = [(b[0], b[0] - a[0], b[1]) for a, b in zip(deltas, deltas[1:])]       # (time, gap, tokens)
    return {"ok": ok, "ttft": ttft, "e2e": e2e, "tpot": tpot(e2e, ttft, n) if ok else None,
            "queue": rec.get("queue_s"), "tokens": n, "gaps": gaps}


def meets_slo(m: dict, ttft_s: float, tpot_s: float) -> bool:
    """Succeeded, first token within `ttft_s`, and (if it has one) TPOT within `tpot_s`."""
    return (m["ok"] and m["ttft"] is not None and m["ttft"] <= ttft_s
            and (m["tpot"] is None or m["tpot"] <= tpot_s))


def makespan(recs: list[dict]) -> float:
    """First send to last end (seconds); 0 when nothing was sent."""
    sends = [r["send"] for r in recs if r["send"] is not None]
    ends = [r["end"] for r in recs if r["end"] is not None]
    return max(0.0, max(ends) - min(sends)) if sends and ends else 0.0


def goodput(ms: list[dict], span_s: float, ttft_s: float, tpot_s: float) -> dict:
    """Requests meeting both SLOs: count, per second of `span_s`, and share of all requests."""
    good = sum(meets_slo(m, ttft_s, tpot_s) for m in ms)
    return {"count": good, "rps": good / span_s if span_s > 0 else 0.0,
            "fraction": good / len(ms) if ms else 0.0}


def tenant_shares(recs: list[dict], ms: list[dict]) -> dict:
    """Per tenant: requests, successes, output tokens, share of all output tokens, TTFT p50/p99 (ms)."""
    total = sum(m["tokens"] for m in ms)
    out = {}
    for name in sorted({r["tenant"] for r in recs}):
        mine = [m for r, m in zip(recs, ms) if r["tenant"] == name]
        tokens = sum(m["tokens"] for m in mine)
        ttfts = [m["ttft"] * 1000 for m in mine if m["ttft"] is not None]
        out[name] = {"requests": len(mine), "ok": sum(m["ok"] for m in mine), "output_tokens": tokens,
                     "share": tokens / total if total else 0.0,
                     "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99)}
    return out


def long_windows(recs: list[dict]) -> list[tuple[float, float]]:
    """(send, first token) of each long-prompt request: while its prompt is prefilled."""
    out = []
    for r in recs:
        if r["long"] and r["send"] is not None:
            end = r["deltas"][0][0] if r["deltas"] else r["end"]
            if end is not None:
                out.append((r["send"], end))
    return out


def gaps_in_windows(recs: list[dict], ms: list[dict], windows) -> list[float]:
    """ITL gaps of the other requests that overlap any window (a stall that spans a whole
    prefill ends after it, and must still count)."""
    return [g for r, m in zip(recs, ms) if not r["long"] for t, g, _ in m["gaps"]
            if any(a <= t and t - g <= b for a, b in windows)]


def stats_summary(samples: list[dict]) -> dict:
    """From the server's stats samples: preemptions during the run, peak KV usage, peak queues."""
    def col(k):
        return [s[k] for s in samples if s.get(k) is not None]

    pre = col("num_preemptions")
    peak = lambda k: max(col(k), default=None)  # noqa: E731
    return {"samples": len(samples), "preemptions": pre[-1] - pre[0] if pre else None,
            "peak_kv_usage": peak("kv_cache_usage"), "peak_waiting": peak("waiting"),
            "peak_running": peak("running"), "peak_swapped": peak("swapped")}


def summarize(recs: list[dict], samples: list[dict], slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """Everything the table and the JSON report for one run."""
    ms = [request_metrics(r) for r in recs]
    span = makespan(recs)
    done = [m for m in ms if m["ok"]]
    tokens = sum(m["tokens"] for m in ms)
    gaps = [g for m in ms for _, g, _ in m["gaps"]]
    lag = [r["send"] - r["arrival"] for r in recs if r["send"] is not None and r["arrival"] is not None]
    stats = stats_summary(samples)
    pre = stats["preemptions"]
    return {
        "requests": len(recs), "ok": len(done), "failed": len(recs) - len(done),
        "failures": dict(Counter(r["error"] for r in recs if r["error"] is not None)),
        "makespan_s": span, "output_tokens": tokens,
        "throughput_rps": len(done) / span if span else 0.0, "output_tps": tokens / span if span else 0.0,
        "goodput": goodput(ms, span, slo_ttft_ms / 1000, slo_tpot_ms / 1000),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "ttft_ms": dist(m["ttft"] for m in ms), "itl_ms": dist(gaps),
        "itl_long_prefill_ms": dist(gaps_in_windows(recs, ms, long_windows(recs))),
        "tpot_ms": dist(m["tpot"] for m in ms), "e2e_ms": dist(m["e2e"] for m in ms),
        "queue_ms": dist(m["queue"] for m in ms), "send_lag_ms": dist(lag),
        "merged_tokens": sum(max(0, output_tokens(r) - len(r["deltas"])) for r in recs if r["deltas"]),
        "tenants": tenant_shares(recs, ms), **stats,
        "preemptions_per_request": pre / len(recs) if pre is not None and recs else None,
    }


# -- the table ------------------------------------------------------------------------------
def fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f} ms" if v < 10 else f"{v:.0f} ms" if v < 1000 else f"{v / 1000:.2f} s"


def _dist_row(key: str, qs=("p50", "p90", "p99", "max")):
    return lambda s: " / ".join(fmt_ms(s[key][q]) for q in qs)


ROWS = [
    ("requests ok / sent", lambda s: f"{s['ok']} / {s['requests']}"),
    ("failures", lambda s: ", ".join(f"{k} {v}" for k, v in sorted(s["failures"].items())) or "none"),
    ("makespan", lambda s: f"{s['makespan_s']:.1f} s"),
    ("throughput", lambda s: f"{s['throughput_rps']:.2f} req/s"),
    ("output tokens/s", lambda s: f"{s['output_tps']:.1f} tok/s"),
    ("goodput (both SLOs)", lambda s: f"{s['goodput']['rps']:.2f} req/s ({s['goodput']['fraction']:.0%})"),
    ("TTFT p50 / p90 / p99 / max", _dist_row("ttft_ms")),
    ("ITL p50 / p90 / p99 / max", _dist_row("itl_ms")),
    ("ITL in long prefill p50/p90/p99/max", _dist_row("itl_long_prefill_ms")),
    ("TPOT p50 / p90 / p99 / max", _dist_row("tpot_ms")),
    ("e2e p50 / p90 / p99 / max", _dist_row("e2e_ms")),
    ("queue p50 / p90 / p99 / max", _dist_row("queue_ms")),
    ("preemptions", lambda s: "-" if s.get("preemptions") is None else str(s["preemptions"])),
    ("peak KV usage", lambda s: "-" if s.get("peak_kv_usage") is None else f"{s['peak_kv_usage']:.1%}"),
    ("client send lag p99", lambda s: fmt_ms(s["send_lag_ms"]["p99"])),
    ("weighted split, backlogged (server)", lambda s: describe(s["weighted_service"], "server")),
    ("weighted split, backlogged (client)", lambda s: describe(s["weighted_service"], "client")),
]


def _cell(fn, s: dict) -> str:
    try:
        return fn(s)
    except (KeyError, TypeError):           # a run that measured less (the HF baseline)
        return "-"


def format_table(runs: list[dict]) -> list[str]:
    """Metrics down, runs across; every number with its unit."""
    rows = [("", [r["label"] for r in runs])]
    rows += [(name, [_cell(fn, r["summary"]) for r in runs]) for name, fn in ROWS]
    ws = lambda s: (s.get("weighted_service", {}).get("client") or {}).get("tenants", {})  # noqa: E731
    for t in sorted({t for r in runs for t in [*r["summary"].get("tenants", {}), *ws(r["summary"])]}):
        def tenant(s, t=t):
            x = s["tenants"].get(t)
            return "-" if x is None else (f"{x['ok']}/{x['requests']} req, {x['share']:.0%} of tokens, "
                                          f"TTFT {fmt_ms(x['ttft_p50_ms'])} / {fmt_ms(x['ttft_p99_ms'])}")
        rows.append((f"tenant {t} (TTFT p50 / p99)", [_cell(tenant, r["summary"]) for r in runs]))

        for source in ("server", "client"):
            def service(s, t=t, source=source):
                x = s["weighted_service"][source]["tenants"][t]
                return (f"{x['prompt_tokens']:.0f} in + 2 x {x['output_tokens']:.0f} out = {x['service']:.0f}, "
                        f"/ weight {x['per_weight']:.0f}")
            rows.append((f"tenant {t} weighted service ({source})", [_cell(service, r["summary"]) for r in runs]))
    w0 = max(len(n) for n, _ in rows)
    widths = [max(len(cells[i]) for _, cells in rows) for i in range(len(runs))]
    return [f"{name:<{w0}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) for name, cells in rows]
