"""`streamgate-bench NAME [ARGS]` (or `python -m bench NAME [ARGS]`): run the benchmark
`bench/WING/NAME.py`, NAME written `WING.NAME` (`engine.offline`, `serving.serve`, `isolation`,
`peers`), with its own flags (`streamgate-bench NAME --help`). The flat names from before the
wings (`offline`, `serve`, `peers_setup`, ...) still work for one release. The benchmarks have
their own entry point so the gateway never imports them. `streamgate-bench report [--check]`
rewrites docs/BENCHMARKS.md's generated tables from the published runs' JSON (bench/report.py)."""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from pathlib import Path

WINGS = ("engine", "serving", "isolation", "peers")
RUNS = {"isolation": "isolation.run", "peers": "peers.run"}   # a wing run as a whole

# The flat names bench/ had before the wings; kept one release (a deprecation line when used).
OLD_NAMES = {"peers_setup": "peers.setup", "isolation_attacks": "isolation.attacks"}
TOOLS = {"report": "report"}          # not benchmarks: bench/NAME.py, outside the wings


def benchmarks() -> dict[str, str]:
    """{name: module under bench} for every module of a wing that defines `main`."""
    here = Path(__file__).parent
    found = {f"{wing}.{p.stem}": f"{wing}.{p.stem}" for wing in WINGS for p in sorted((here / wing).glob("*.py"))
             if not p.stem.startswith("_") and "\ndef main(" in p.read_text()}
    for name, module in RUNS.items():
        found[name] = found.pop(module)
    return dict(sorted(found.items()))


def resolve(name: str) -> str | None:
    """The module (under bench) that NAME names, new or old spelling; None if none."""
    if name in TOOLS:
        return TOOLS[name]
    names = benchmarks()
    if name in names:
        return names[name]
    old = OLD_NAMES.get(name) or next((n for n in names if n.split(".")[-1] == name), None)
    if old is None:
        return None
    logging.getLogger("streamgate").warning("`streamgate-bench %s` is deprecated: use `streamgate-bench %s`",
                                            name, old)
    return names.get(old, old)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    module = resolve(argv[0]) if argv and not argv[0].startswith("-") else None
    if module is None:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(f"{__doc__}\n\nbenchmarks: {', '.join(benchmarks())}\ntools: {', '.join(TOOLS)}",
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    run = importlib.import_module(f"bench.{module}").main
    if inspect.signature(run).parameters:
        return run(argv[1:]) or 0
    sys.argv = [f"streamgate-bench {argv[0]}", *argv[1:]]          # a main() that reads sys.argv itself
    return run() or 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
