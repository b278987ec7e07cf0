"""What a published number needs besides itself: the command that produced it, the build
(commit, and whether the tree had uncommitted changes), the host and the time. Benchmarks put
`provenance(...)` into their JSON as "provenance", stamped at the start and closed with
`finish(...)` at the end; `streamgate-bench report` renders it under each table."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def provenance(module: str, argv: list[str] | None) -> dict:
    """The start of a run of `bench.MODULE` with ARGV (sys.argv[1:] when None)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"benchmark": module, "command": shlex.join(["python", "-m", f"bench.{module}", *argv]),
            "commit": _git("rev-parse", "--short=7", "HEAD"), "dirty": bool(status) if status is not None else None,
            "host": platform.node(), "cpu": _cpu(), "cpus": os.cpu_count(), "started": _now(),
            "loadavg_start": os.getloadavg()[0]}


def finish(prov: dict) -> dict:
    """PROV with the end of the run stamped (time, load average)."""
    return {**prov, "finished": _now(), "loadavg_end": os.getloadavg()[0]}
