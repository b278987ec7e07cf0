"""What every renderer shares: number formatting, the caption naming a run's command, build,
host, date and load, and the markdown table under it."""

from __future__ import annotations


def _n(x: int | float | None) -> str:
    return "—" if x is None else f"{x:,}"


def _utc(stamp: str | None) -> str:
    """'2026-12-02T00:53:10Z' -> '00:53:10' (the date goes in the caption once)."""
    return "?" if not stamp else stamp.split("T", 1)[-1].rstrip("Z")


def caption(data: dict, name: str, extra: str = "") -> str:
    """Command, build, host, date and load of the run, and where its JSON is."""
    p = data.get("provenance") or {}
    build = f"commit `{p.get('commit') or '?'}`" + (" with uncommitted changes" if p.get("dirty") else "")
    host = p.get("host_label") or (f"`{p['host']}`" if p.get("host") else "host not recorded")
    cpu = f" ({p['cpu']}{'; ' + p['isa'] if p.get('isa') else ''})" if p.get("cpu") else ""
    date = (p.get("started") or "?").split("T", 1)[0]
    when = f"{date} {_utc(p.get('started'))}–{_utc(p.get('finished'))} UTC"
    loads = data.get("loadavg_range") or [v for v in (p.get("loadavg_start"), p.get("loadavg_end")) if v is not None]
    load = f", load average {min(loads):.1f}–{max(loads):.1f}" if loads else ""
    text = f"`{p.get('command', '?')}`, {build}, {host}{cpu}, {when}{load}{extra}."
    if data.get("transcribed"):         # {"from_commit", "note"}: re-created from a published table
        text += (f" **Transcribed** from the table published at `{data['transcribed']['from_commit']}` "
                 "(the run's raw JSON was not kept).")
    return f"{text} JSON: [docs/bench/results/{name}.json](bench/results/{name}.json)."


def _span(values: list | None) -> str:
    if not values:
        return "—"
    lo, hi = min(values), max(values)
    return _n(lo) if lo == hi else f"{lo:,}–{hi:,}"


def table(head: list[str], rows: list[list], align: str | None = None) -> list[str]:
    """A markdown table's lines: HEAD, the separator (ALIGN: an "l" or "r" a column; by default the
    first column left, the others right) and a line per row (its cells as str() gives them)."""
    align = align or "l" + "r" * (len(head) - 1)
    return ["| " + " | ".join(head) + " |", "|" + "".join("---|" if a == "l" else "---:|" for a in align),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]
