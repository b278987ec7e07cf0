"""docs/BENCHMARKS.md §6: streamgate against another server, side by side (`bench.peers`;
the run's peers.json)."""

from __future__ import annotations

from bench.renderers.common import caption


def _tps(x) -> str:
    return "—" if x is None else f"{x:.1f}"


def _s(ms) -> str:
    return "—" if ms is None else f"{ms / 1000:.2f} s"


def _ratio(a, b, bold: bool = False) -> str:
    if a is None or not b:
        return "—"
    return f"**{a / b:.2f}×**" if bold else f"{a / b:.2f}×"


def _pair(a, b, unit: str = " ms") -> str:
    return f"{'—' if a is None else f'{a:.0f}'} / {'—' if b is None else f'{b:.0f}'}{unit}"


def _loads(data: dict) -> list[float]:
    p = data.get("provenance") or {}
    loads = [*(data.get("loadavg_range") or []), p.get("loadavg_start"), p.get("loadavg_end")]
    loads += [s.get(k) for s in data["servers"].values() for k in ("load_before", "load_after")]
    return [x for x in loads if x is not None]


def table(peer: str, peer_rows: list[dict], name: str, rows: list[dict]) -> list[str]:
    """One line per stream count either side measured: tok/s and its ratio, TTFT p99 and its
    ratio (lower is better), ITL p50."""
    base = {r["concurrency"]: r for r in peer_rows}
    mine = {r["concurrency"]: r for r in rows}
    lines = [f"| streams | {peer} tok/s | {name} tok/s | × {peer} | TTFT p99, {peer} / {name} | × {peer} "
             f"| ITL p50, {peer} / {name} |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for c in sorted(base.keys() | mine.keys()):
        b, m = base.get(c, {}), mine.get(c, {})
        lines.append(f"| {c} | {_tps(b.get('output_tps'))} | {_tps(m.get('output_tps'))} | "
                     f"{_ratio(m.get('output_tps'), b.get('output_tps'), bold=True)} | "
                     f"{_s(b.get('ttft_p99_ms'))} / {_s(m.get('ttft_p99_ms'))} | "
                     f"{_ratio(m.get('ttft_p99_ms'), b.get('ttft_p99_ms'))} | "
                     f"{_pair(b.get('itl_p50_ms'), m.get('itl_p50_ms'))} |")
    return lines


def render_peers(data: dict, name: str) -> str:
    a, servers = data["args"], data["servers"]
    peer = a["peer"]
    extra = (f"; {a.get('client', '?')} client, {a.get('prompt_tokens')}-token prompts, {a.get('output_tokens')} output "
             f"tokens, servers in the order {', '.join(servers)}")
    if data.get("env"):
        extra += "; environment " + " ".join(f"`{k}={v}`" for k, v in sorted(data["env"].items()))
    failed = sum(r.get("failed") or 0 for s in servers.values() for r in s.get("rows", []))
    if failed:
        extra += f"; **{failed} requests failed**"
    for note in data.get("skipped", []):
        extra += f"; {note}"
    lines = [caption({**data, "loadavg_range": _loads(data)}, name, extra)]
    others = [n for n, s in servers.items() if n != peer and s.get("rows")]
    for other in others:
        lines.append("")
        if len(others) > 1:
            lines += [f"**{other}** against **{peer}**:", ""]
        lines += table(peer, servers.get(peer, {}).get("rows", []), other, servers[other]["rows"])
    errors = [f"{n}: {e.splitlines()[0]}" for n, s in servers.items() for e in s.get("errors", [])]
    if errors:
        lines += ["", "Errors: " + "; ".join(errors)]
    return "\n".join(lines)


RENDERERS = {"peers": render_peers}
