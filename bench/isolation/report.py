"""The isolation benchmark's verdicts and table: the issue's targets checked per attack
against B's baseline, and one line per phase."""

from __future__ import annotations


def check_targets(phases: dict) -> dict:
    """The issue's targets for each attack: {attack: {target: PASS / MISS / n/a}}."""
    base = phases["baseline"]["gap_max_ms"]
    gap_limit = max(250.0, 3 * base) if base is not None else None
    out = {}
    for name, ph in phases.items():
        if name == "baseline":
            continue
        checks = {"gap": (ph["gap_max_ms"], gap_limit), "health": (ph["health_max_ms"], 100.0),
                  "rss": (ph["rss_growth_mb"], 100.0)}
        out[name] = {t: "n/a" if v is None or lim is None else ("PASS" if v <= lim else "MISS")
                     for t, (v, lim) in checks.items()}
        out[name]["ws"] = "PASS" if ph["b_ws"]["connected"] else "MISS"
        out[name]["idle"] = "PASS" if ph.get("idle_after_s") is not None else "MISS"
    return {"gap_limit_ms": gap_limit, "attacks": out}


def _fmt(v, unit: str = "") -> str:
    return "-" if v is None else f"{v:,.0f}{unit}"


def _refusal(probe: dict) -> str:
    if probe.get("close_code"):
        return f"closed {probe['close_code']}"
    if probe.get("http_status"):
        return f"HTTP {probe['http_status']}"
    return "timeout" if probe.get("error") == "TimeoutError" else str(probe.get("error"))


def report(phases: dict, targets: dict) -> list[str]:
    """The table: per phase B's largest gap (and when it began, from the phase's start), its
    median gap, /health max and median, RSS growth, the CPU time of the server's event-loop
    thread in the window (B's streaming included), B's WebSocket probe, error-level lines
    the server logged, and what A got back; then PASS/MISS per target."""
    lines = [f"{'phase':15} {'B gap max':>10} {'from':>6} {'p50':>6} {'/health max':>12} {'p50':>5} {'RSS +MB':>8} "
             f"{'loop CPU':>9} {'B WS':>15} {'logged errors':>13}  A got"]
    for name, ph in phases.items():
        ws = ph["b_ws"]
        ws_s = f"ok {ws['ms']:,.0f}ms" if ws["connected"] else "no: " + _refusal(ws)
        logged = ph["log"]["error_lines"] if ph["log"] else None
        got = ph["attacker"]["outcome"] if ph["attacker"] else "-"
        start = "-" if ph["gap_max_from_s"] is None else f"{ph['gap_max_from_s']:+.1f}s"
        lines.append(f"{name:15} {_fmt(ph['gap_max_ms'], 'ms'):>10} {start:>6} {_fmt(ph['gap_p50_ms']):>6} "
                     f"{'>=' * bool(ph['health_timeouts']) + _fmt(ph['health_max_ms'], 'ms'):>12} "
                     f"{_fmt(ph['health_p50_ms']):>5} "
                     f"{_fmt(ph['rss_growth_mb']):>8} {_fmt(ph.get('loop_cpu_ms'), 'ms'):>9} {ws_s:>15} "
                     f"{_fmt(logged):>13}  {got}")
        if ph["b_errors"]:
            lines.append(f"{'':15} B got errors: {', '.join(ph['b_errors'])}")
    lines.append("")
    lines.append(f"targets: B gap <= {_fmt(targets['gap_limit_ms'], ' ms')} (max(250 ms, 3x baseline)), "
                 f"/health <= 100 ms, RSS growth <= 100 MB, B's WebSocket connects, gauges idle within 15 s")
    for name, checks in targets["attacks"].items():
        lines.append(f"{name:15} " + "  ".join(f"{t} {v}" for t, v in checks.items()))
    return lines
