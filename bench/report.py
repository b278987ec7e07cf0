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

from bench.renderers import RENDERERS  # one module per benchmark

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BENCHMARKS.md"
RESULTS = ROOT / "docs" / "bench" / "results"
REGION = re.compile(r"^<!-- generated: ([\w.-]+) -->\n.*?^<!-- /generated -->$", re.S | re.M)
OPEN = re.compile(r"^<!-- generated: ([\w.-]+) -->$", re.M)


class ReportError(Exception):
    pass


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
