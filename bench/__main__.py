"""`streamgate-bench NAME [ARGS]` (or `python -m bench NAME [ARGS]`): run the benchmark
`bench/NAME.py` with its own flags (`streamgate-bench NAME --help`). The benchmarks have
their own entry point so the gateway never imports them."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def benchmarks() -> list[str]:
    """The modules of bench/ that are benchmarks (they define `main`)."""
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)])
                  if not m.name.startswith("_") and "\ndef main(" in (here / f"{m.name}.py").read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = benchmarks()
    if not argv or argv[0] not in names:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(f"{__doc__}\nbenchmarks: {', '.join(names)}", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    module = importlib.import_module(f"bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
