"""docs/BENCHMARKS.md §2 (the batching modes served) and §3 (weighted service): one
`bench.serving.serve` run, a row per `--compare` preset (and rate), and, where a run has one, the
split of weighted service between the heaviest and the lightest tenant, by the server's counters
and by the client's records. A field the run did not record (or a transcription did not publish)
is "—", and a column no run has is left out."""

from __future__ import annotations

from bench.renderers.common import caption, table

ITL_RATIO_TARGET = 2.0         # chunked prefill: ITL p99 <= 2x p50 while a long prompt prefills
SPEEDUP_TARGET = 2.0           # continuous batching: >= 2x static's output tok/s


def _t(ms: float | None) -> str:
    """A latency: '8.5 ms', '485 ms', '1.81 s', '23.3 s'."""
    if ms is None:
        return "—"
    if ms < 1000:
        return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"
    return f"{ms / 1000:.2f} s" if ms < 10_000 else f"{ms / 1000:.1f} s"


def _q(d: dict | None, *qs: str) -> str:
    return " / ".join(_t((d or {}).get(q)) for q in qs)


def _ratio(d: dict | None) -> float | None:
    d = d or {}
    return d["p99"] / d["p50"] if d.get("p50") and d.get("p99") is not None else None


def _chunked(run: dict) -> bool:
    """Decode-first with chunked prefill (the server's default): not static, not prefill-first."""
    flags = run.get("flags") or []
    return "--no-chunked-prefill" not in flags and "static" not in flags and run.get("driver") != "hf"


def _long_prefill(run: dict) -> str:
    d = run["summary"].get("itl_long_prefill_ms")
    r = _ratio(d)
    if r is None:
        return "—"
    cell = f"{r:.2f}"
    if _chunked(run):
        cell = f"**{cell}** ({'met' if r <= ITL_RATIO_TARGET else 'missed'})"
    return f"{_q(d, 'p50', 'p99')}, {cell}"


def _num(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _goodput(s: dict) -> str:
    g = s.get("goodput") or {}
    if g.get("rps") is None:
        return "—"
    return f"{g['rps']:.2f} req/s ({100 * g['fraction']:.0f} %)" if g.get("fraction") is not None else f"{g['rps']:.2f}"


def _split(ws: dict | None, source: str) -> str:
    x = (ws or {}).get(source) or {}
    if x.get("split") is None:
        return "—"
    err = "" if x.get("error") is None else f", {100 * x['error']:+.1f} %"
    return f"**{x['split']:.2f} : 1**" + (f" (target {x['target']:g}{err})" if x.get("target") else "")


def _pair(runs: list[dict]) -> list[str] | None:
    """The heaviest and lightest tenant of the first run with a weighted split."""
    for r in runs:
        ws = r["summary"].get("weighted_service") or {}
        for source in ("server", "client"):
            if (ws.get(source) or {}).get("pair"):
                return ws[source]["pair"]
    return None


def _workload(data: dict) -> str:
    w, a = data.get("workload") or {}, data.get("args") or {}
    rate = f" at {w['rate']:g} req/s" if w.get("arrival") == "poisson" and w.get("rate") else ""
    bits = [w["arrival"].replace("closed", "closed loop") + rate if w.get("arrival") else None,
            f"up to {w['num_requests']:,} requests" if w.get("num_requests") else None]
    weights = {t["name"]: t.get("weight", 1.0) for t in w.get("tenants") or []}
    if len(set(weights.values())) > 1:
        bits.append("weights " + ", ".join(f"{n} {x:g}" for n, x in weights.items()))
    slo = w.get("slo") or {}
    if slo.get("ttft_ms") is not None:
        bits.append(f"goodput: TTFT ≤ {slo['ttft_ms']:g} ms and TPOT ≤ {slo.get('tpot_ms', 0):g} ms")
    text = f"; workload `{w.get('name') or a.get('workload', '?')}`"
    text += f" ({', '.join(b for b in bits if b)})" if any(bits) else ""
    text += f", driver {a['driver']}" if a.get("driver") else ""
    return text + (f", model `{a['model']}`" if a.get("model") else "")


def _tps(run: dict, static: float | None) -> str:
    """Output tok/s, and beside a `static` run's the multiple of it (with the target for `continuous`)."""
    tps = run["summary"].get("output_tps")
    if tps is None or not static or run["label"] == "static":
        return _num(tps, ".1f")
    x = tps / static
    if run["label"] != "continuous":
        return f"{tps:.1f} ({x:.2f}×)"
    return f"{tps:.1f} (**{x:.2f}×**, {'met' if x >= SPEEDUP_TARGET else 'missed'})"


def render_serve(data: dict, name: str) -> str:
    runs = data["runs"]
    pair = _pair(runs)
    static = next((r["summary"].get("output_tps") for r in runs if r["label"] == "static"), None)
    head = ["run", "server flags", "ok / sent", "output tok/s" + (" (× static)" if static else ""),
            "TTFT p50 / p99", "ITL p50 / p99 / max", "ITL p99 / p50",
            "ITL while a long prompt prefills: p50 / p99, p99 / p50", "goodput", "preemptions / request"]
    if pair:
        w = f"weighted {pair[0]} : {pair[1]}"
        head += [f"{w} (server's counters)", f"{w} (client's records)", "both backlogged"]
    rows = []
    for r in runs:
        s = r["summary"]
        flags = " ".join(r.get("flags") or [])
        ratio = _ratio(s.get("itl_ms"))
        cells = [r["label"], f"`{flags}`" if flags else "(default)",
                 f"{_num(s.get('ok'), ',')} / {_num(s.get('requests'), ',')}", _tps(r, static),
                 _q(s.get("ttft_ms"), "p50", "p99"), _q(s.get("itl_ms"), "p50", "p99", "max"),
                 _num(ratio, ".2f"), _long_prefill(r), _goodput(s), _num(s.get("preemptions_per_request"), ".2f")]
        if pair:
            ws = s.get("weighted_service") or {}
            until = ws.get("until_s")
            cells += [_split(ws, "server"), _split(ws, "client"), "—" if until is None else f"0–{until:.0f} s"]
        rows.append(cells)
    # A column no run recorded (a transcription of a table that did not publish it) is left out.
    keep = [i for i in range(len(head)) if i < 2 or any(set(row[i]) - set("—/ ") for row in rows)]
    body = [[row[i] for i in keep] for row in rows]
    return "\n".join([caption(data, name, _workload(data)), "",
                      *table([head[i] for i in keep], body, "ll" + "r" * (len(keep) - 2))])


RENDERERS = {"serving.serve": render_serve}
