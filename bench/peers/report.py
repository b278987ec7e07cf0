"""The peer comparison's numbers: GuideLLM's JSON report (or a loadgen summary) → one row
per concurrency level → a table with ratios against a peer, as text and markdown. Pure
functions: no I/O.

A row: `concurrency`, `ok`, `failed`, `output_tokens` (of successful requests),
`output_tps` (output tokens per second of the level's wall time), `ttft_p50_ms`,
`ttft_p99_ms`, `itl_p50_ms`, `itl_p99_ms` (ITL: each request's (latency - TTFT) / (tokens - 1)).
A grounded run's rows also have `workload` (edit, summarize) and `prompt_tokens`; rows are
compared by workload and concurrency.
"""

from __future__ import annotations

class ReportError(ValueError):
    """GuideLLM's output is not shaped as expected; the message names the missing key."""


def _get(doc, path: str, where: str = ""):
    """`doc` at a dotted path, or ReportError naming the first missing part (after `where`)."""
    cur, seen = doc, [where] if where else []
    for key in path.split("."):
        seen.append(key)
        if not isinstance(cur, dict) or key not in cur:
            raise ReportError(f"GuideLLM report: no {'.'.join(seen)}")
        cur = cur[key]
    return cur


def rows_from_guidellm(doc: dict) -> list[dict]:
    """One row per benchmark of a GuideLLM 0.8 report (concurrent profile), sorted by
    streams. Its ITL is per request, (latency - TTFT) / (tokens - 1), counted once per token."""
    rows = []
    for i, bench in enumerate(_get(doc, "benchmarks")):
        get = lambda path: _get(bench, path, f"benchmarks[{i}]")  # noqa: E731
        totals = get("metrics.request_totals")
        out_tokens, duration = get("metrics.output_token_count.successful.total_sum"), get("duration")
        ok = int(totals["successful"])
        # GuideLLM reports 0 for the percentiles of no requests: no number, not a fast one.
        pct = lambda metric, q: get(f"metrics.{metric}.successful.percentiles.{q}") if ok else None  # noqa: E731
        rows.append({
            "concurrency": int(get("config.strategy.streams")), "ok": ok,
            "failed": int(totals.get("errored", 0)) + int(totals.get("incomplete", 0)),
            "output_tokens": int(out_tokens), "output_tps": out_tokens / duration if duration else 0.0,
            "ttft_p50_ms": pct("time_to_first_token_ms", "p50"), "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
            "itl_p50_ms": pct("inter_token_latency_ms", "p50"), "itl_p99_ms": pct("inter_token_latency_ms", "p99"),
        })
    return sorted(rows, key=lambda r: r["concurrency"])


def row_from_summary(summary: dict, concurrency: int) -> dict:
    """A `bench.servestats.summarize` result as a row. Its ITL is the per-request TPOT:
    GuideLLM's definition (which weighs each request by its tokens, the same here since
    every request has the same output length)."""
    return {"concurrency": concurrency, "ok": summary["ok"], "failed": summary["failed"],
            "output_tokens": summary["output_tokens"], "output_tps": summary["output_tps"],
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "itl_p50_ms": summary["tpot_ms"]["p50"], "itl_p99_ms": summary["tpot_ms"]["p99"]}


def level(row: dict) -> int | tuple[str, int]:
    """What a row is compared by: its concurrency, or (workload, concurrency) for a grounded row."""
    return (row["workload"], row["concurrency"]) if "workload" in row else row["concurrency"]


def ratios(results: dict[str, list[dict]], peer: str) -> dict[str, dict]:
    """Per server and level (`level`): output tok/s over the peer's (higher is better) and
    TTFT p99 over the peer's (lower is better); None where either side has no number."""
    base = {level(r): r for r in results.get(peer, [])}
    out: dict[str, dict] = {}
    for name, rows in results.items():
        for r in rows:
            b = base.get(level(r))
            out.setdefault(name, {})[level(r)] = {
                "output_tps": _ratio(r["output_tps"], b and b["output_tps"]),
                "ttft_p99": _ratio(r["ttft_p99_ms"], b and b["ttft_p99_ms"])}
    return out


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.1f} s" if x >= 10_000 else f"{x:.0f} ms"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


HEADER = ("server", "streams", "ok/failed", "out tok/s", "x peer", "TTFT p50", "TTFT p99", "x peer", "ITL p50")


def _grounded(results: dict[str, list[dict]]) -> bool:
    return any("workload" in r for rows in results.values() for r in rows)


def header(results: dict[str, list[dict]]) -> tuple[str, ...]:
    """HEADER, with a workload column after the server's for a grounded run."""
    return (HEADER[0], "workload", *HEADER[1:]) if _grounded(results) else HEADER


def table_rows(results: dict[str, list[dict]], peer: str | None) -> list[tuple[str, ...]]:
    """The comparison table's cells (columns as `header`), one line per server and level."""
    rel = ratios(results, peer) if peer in results else {}
    lines = []
    for name, rows in results.items():
        for r in rows:
            q = rel.get(name, {}).get(level(r), {})
            lead = (name, r["workload"]) if "workload" in r else (name,)
            lines.append((*lead, str(r["concurrency"]), f"{r['ok']}/{r['failed']}", f"{r['output_tps']:.1f}",
                          _x(q.get("output_tps")), _ms(r["ttft_p50_ms"]), _ms(r["ttft_p99_ms"]),
                          _x(q.get("ttft_p99")), _ms(r["itl_p50_ms"])))
    return lines


def format_text(results: dict[str, list[dict]], peer: str | None) -> list[str]:
    """A fixed-width table for the terminal."""
    head = header(results)
    cells = [head, *table_rows(results, peer)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(c))) for c in cells]


def format_markdown(results: dict[str, list[dict]], peer: str | None, notes: list[str]) -> str:
    """The table as markdown, ratios against `peer`, followed by `notes` as a list."""
    head, cells = header(results), table_rows(results, peer)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    lines.append("\n\"failed\" counts requests that errored or were still running at the level's time bound.")
    if peer in results:
        lines.append(f"\"x peer\" is against {peer}: output tok/s over its (higher is better), "
                     "TTFT p99 over its (lower is better).")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"
