"""`streamgate-bench report [--check]` (or `python -m bench report`): rewrite docs/BENCHMARKS.md's
generated tables from the published runs' JSON, so the page cannot drift from the runs.

A published run is the JSON a benchmark wrote with `--json-out` (into the git-ignored
bench/results/), copied to docs/bench/results/NAME.json. In the page, a region

    <!-- generated: NAME -->
    ...
    <!-- /generated -->

is replaced by the caption and table rendered from NAME.json (by the renderer for the
benchmark its "provenance" names); everything outside the regions is left alone. `--check`
writes nothing and exits 1 if the page differs from what it would write (2 on a missing or
unreadable JSON, an unknown benchmark or an unclosed region).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BENCHMARKS.md"
RESULTS = ROOT / "docs" / "bench" / "results"
REGION = re.compile(r"^<!-- generated: ([\w.-]+) -->\n.*?^<!-- /generated -->$", re.S | re.M)
OPEN = re.compile(r"^<!-- generated: ([\w.-]+) -->$", re.M)


class ReportError(Exception):
    pass


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
    cpu = f" ({p['cpu']})" if p.get("cpu") else ""
    date = (p.get("started") or "?").split("T", 1)[0]
    when = f"{date} {_utc(p.get('started'))}–{_utc(p.get('finished'))} UTC"
    loads = data.get("loadavg_range") or [v for v in (p.get("loadavg_start"), p.get("loadavg_end")) if v is not None]
    load = f", load average {min(loads):.1f}–{max(loads):.1f}" if loads else ""
    text = f"`{p.get('command', '?')}`, {build}, {host}{cpu}, {when}{load}{extra}."
    if data.get("transcribed"):         # {"from_commit", "note"}: re-created from a published table
        text += (f" **Transcribed** from the table published at `{data['transcribed']['from_commit']}` "
                 "(the run's raw JSON was not kept).")
    return f"{text} JSON: [docs/bench/results/{name}.json](bench/results/{name}.json)."


# -- bench.engine.families kv ------------------------------------------------------------------------
KV_LAYOUTS = {"all-sliding-512 (32 layers)": "32 layers, all sliding over 512",
              "gemma3-1b (5:1, window 512)": "Gemma 3 1B (26 layers, 5 sliding over 512 : 1 full)",
              "gpt-oss-20b (1:1, window 128)": "gpt-oss-20b (24 layers, 1 sliding over 128 : 1 full)"}


def render_families_kv(data: dict, name: str) -> str:
    a, result = data["args"], data["result"]
    lines = [caption(data, name, f"; {a['tokens']:,} tokens, {a['prompt']:,}-token prompt, blocks of {a['block_size']}"),
             "",
             "| layout | freeing | groups x rows | blocks at admission | blocks at the end | layer-blocks at admission "
             "| layer-blocks at the end |",
             "|---|---|---|---:|---:|---:|---:|"]
    layouts = dict.fromkeys(key.rsplit(" / ", 1)[0] for key in result)
    for layout in layouts:
        free, keep = result.get(f"{layout} / free"), result.get(f"{layout} / keep")
        for i, (label, r) in enumerate((("yes", free), ("no", keep))):
            if r is None:
                continue
            end = _n(r["layer_blocks_end"])
            if label == "yes" and keep:
                end = f"**{end}** ({keep['layer_blocks_end'] / r['layer_blocks_end']:.1f}x less)"
            lines.append(f"| {KV_LAYOUTS.get(layout, layout) if i == 0 or free is None else ''} | {label} | "
                         f"{r['groups']} x {r['rows']} | {_n(r['admission'])} | {_n(r['end'])} | "
                         f"{_n(r['layer_blocks_admission'])} | {end} |")
    return "\n".join(lines)


# -- bench.engine.speculative ------------------------------------------------------------------------
SPEC_WORKLOADS = {"chat": "open chat"}


def _span(values: list | None) -> str:
    if not values:
        return "—"
    lo, hi = min(values), max(values)
    return _n(lo) if lo == hi else f"{lo:,}–{hi:,}"


def render_speculative(data: dict, name: str) -> str:
    rows = data["rows"]
    bound = rows[0]["bound_tok_s"] if rows else None
    extra = f"; {data.get('dtype', '?')}, k = {data['args']['k']}"
    if data.get("bandwidth"):
        extra += f", read bandwidth {data['bandwidth'] / 1e9:.1f} GB/s, one-row decode bound {bound:.1f} tok/s"
    loads = [r["load"] for r in rows if r.get("load") is not None]
    if loads and not data.get("loadavg_range"):
        data = {**data, "loadavg_range": loads + [v for v in (data.get("provenance", {}).get(k) for k in
                                                               ("loadavg_start", "loadavg_end")) if v is not None]}

    def rate(pair: list[float]) -> str:
        share = f", {round(100 * pair[1] / bound)} %" if bound else ""
        return f"{pair[0]:.1f} ({pair[1]:.1f}{share})"

    lines = [caption(data, name, extra), "",
             "| workload | prompt tokens | output tokens | off: tok/s (decode, % of bound) | on: tok/s (decode, % of bound) "
             "| decode on/off | drafts accepted | same tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {SPEC_WORKLOADS.get(r['workload'], r['workload'])} | {_span(r.get('prompt_tokens'))} | "
                     f"{_n(r.get('output_tokens'))} | {rate(r['off_tok_s'])} | {rate(r['on_tok_s'])} | "
                     f"{r['speedup_decode']:.2f}× | {r['accepted']} / {r['drafted']} | "
                     f"{'yes' if r['same_tokens'] else 'no'} |")
    return "\n".join(lines)


RENDERERS = {"engine.families kv": render_families_kv, "engine.speculative": render_speculative}


def renderer_for(data: dict):
    bench = (data.get("provenance") or {}).get("benchmark")
    mode = (data.get("args") or {}).get("mode")
    return RENDERERS.get(f"{bench} {mode}") or RENDERERS.get(bench)


def render(name: str, results: Path) -> str:
    path = results / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"generated region {name!r}: cannot read {path}: {e}") from e
    fn = renderer_for(data)
    if fn is None:
        raise ReportError(f"generated region {name!r}: no renderer for benchmark "
                          f"{(data.get('provenance') or {}).get('benchmark')!r} in {path}")
    return fn(data, name)


def rewrite(text: str, results: Path) -> str:
    """TEXT with every generated region re-rendered from RESULTS."""
    opened = OPEN.findall(text)
    closed = REGION.findall(text)
    if opened != closed:
        raise ReportError(f"generated regions opened {opened} but closed {closed}: each needs <!-- /generated -->")
    return REGION.sub(lambda m: f"<!-- generated: {m[1]} -->\n\n{render(m[1], results)}\n\n<!-- /generated -->",
                      text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="streamgate-bench report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is not up to date")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    text = args.doc.read_text()
    try:
        new = rewrite(text, args.results)
    except ReportError as e:
        print(f"streamgate-bench report: {e}", file=sys.stderr)
        return 2
    regions = REGION.findall(new)
    if args.check:
        if new != text:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       str(args.doc), f"{args.doc} (regenerated)"))
            print(f"{args.doc} is out of date with {args.results}: run `streamgate-bench report`", file=sys.stderr)
            return 1
        print(f"{args.doc}: {len(regions)} generated regions up to date ({', '.join(regions)})")
        return 0
    if new != text:
        args.doc.write_text(new)
    print(f"{args.doc}: {len(regions)} generated regions {'rewritten' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
