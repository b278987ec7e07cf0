"""docs/BENCHMARKS.md §4: tenant isolation under attack (`bench.isolation`)."""

from __future__ import annotations

from bench.renderers.common import caption


def _ms(x) -> str:
    return "—" if x is None else f"{x:,.0f} ms"


def _ws(probe: dict) -> str:
    if probe.get("connected") is None:          # not recorded (a transcribed run)
        return "—"
    if probe.get("connected"):
        return f"ok, {probe['ms']:,.0f} ms" if probe.get("ms") is not None else "ok"
    why = (f"closed {probe['close_code']}" if probe.get("close_code") else
           f"HTTP {probe['http_status']}" if probe.get("http_status") else str(probe.get("error")))
    return f"**no**: {why}"


def _verdict(checks: dict | None) -> str:
    if not checks:
        return "—"
    missed = [t for t, v in checks.items() if v == "MISS"]
    return f"**MISS**: {', '.join(missed)}" if missed else f"{sum(v == 'PASS' for v in checks.values())} pass"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_isolation(data: dict, name: str) -> str:
    a, phases, targets = data["args"], data["phases"], data["targets"]
    checks = [v for c in targets["attacks"].values() for v in c.values()]
    passed = sum(v == "PASS" for v in checks)
    loads = list(data.get("loadavg_range") or [])          # a transcribed run's, else each phase's and the ends'
    loads += [ph["loadavg_1m"] for ph in phases.values() if ph.get("loadavg_1m") is not None]
    p = data.get("provenance") or {}
    loads += [v for v in (p.get("loadavg_start"), p.get("loadavg_end")) if v is not None]
    named = {"gap": f"B's largest gap ≤ {_ms(targets['gap_limit_ms'])} (max(250 ms, 3× baseline))",
             "health": "`/health` ≤ 100 ms", "rss": "RSS growth ≤ 100 MB", "ws": "B's WebSocket connects",
             "idle": "gauges idle within 15 s"}
    checked = {t for c in targets["attacks"].values() for t in c}
    extra = (f"; B streams {a['b_max_tokens']}-token answers, "
             f"{'one server for every attack' if a.get('shared_server') else 'a fresh server per attack'}; targets: "
             + ", ".join(text for t, text in named.items() if t in checked)
             + f": **{passed} of {len(checks)} checks pass**")
    if (data.get("server") or {}).get("exited_during"):
        extra += f"; **the server exited by itself during {', '.join(data['server']['exited_during'])}**"
    lines = [caption({**data, "loadavg_range": loads}, name, extra), "",
             "| attack | B gap max (began at) | B gap p50 | `/health` max | RSS + | loop CPU | B's WebSocket "
             "| server error lines | gauges idle after | targets | what the attacker got |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for attack, ph in phases.items():
        began = "" if ph.get("gap_max_from_s") is None or attack == "baseline" else f" ({ph['gap_max_from_s']:+.1f} s)"
        health = ("≥ " if ph.get("health_timeouts") else "") + _ms(ph.get("health_max_ms"))
        rss = "—" if ph.get("rss_growth_mb") is None else f"{ph['rss_growth_mb']:+.0f} MB"
        logged = "—" if not ph.get("log") else str(ph["log"]["error_lines"])
        idle = "—" if ph.get("idle_after_s") is None else f"{ph['idle_after_s']:.1f} s"
        got = _md(ph["attacker"]["outcome"]) if ph.get("attacker") else "—"
        if ph.get("b_errors"):
            got += f"; **B got errors**: {_md(', '.join(ph['b_errors']))}"
        lines.append(f"| {'baseline' if attack == 'baseline' else f'`{attack}`'} | {_ms(ph.get('gap_max_ms'))}{began} | "
                     f"{_ms(ph.get('gap_p50_ms'))} | {health} | {rss} | {_ms(ph.get('loop_cpu_ms'))} | "
                     f"{_ws(ph['b_ws'])} | {logged} | {idle} | {_verdict(targets['attacks'].get(attack))} | {got} |")
    return "\n".join(lines)


RENDERERS = {"isolation": render_isolation}
