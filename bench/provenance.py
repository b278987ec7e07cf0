"""What a published number needs besides itself: the command that produced it, the build
(commit, and whether the tree had uncommitted changes), the host and the time. Benchmarks put
`provenance(...)` into their JSON as "provenance", stamped at the start and closed with
`finish(...)` at the end; `streamgate-bench report` renders it under each table."""

from __future__ import annotations

import json
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
    """'AMD EPYC, family 25 model 17' from /proc/cpuinfo (the family and model tell the
    generations apart where the name does not); the platform's name elsewhere."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in info:
        return platform.processor() or platform.machine()
    family = f", family {info['cpu family']} model {info.get('model', '?')}" if "cpu family" in info else ""
    return info["model name"] + family


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _isa() -> str:
    """The vector extensions that decide our kernels' paths, as /proc/cpuinfo names them
    ("avx2 avx512f avx512_bf16 avx512_vnni"); "" where there is no cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                return " ".join(f for f in ISA_FLAGS if f in flags)
    except OSError:
        pass
    return ""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def provenance(module: str, argv: list[str] | None) -> dict:
    """The start of a run of `bench.MODULE` with ARGV (sys.argv[1:] when None)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"benchmark": module, "command": shlex.join(["python", "-m", f"bench.{module}", *argv]),
            "commit": _git("rev-parse", "--short=7", "HEAD"), "dirty": bool(status) if status is not None else None,
            "host": platform.node(), "cpu": _cpu(), "isa": _isa(), "cpus": os.cpu_count(), "started": _now(),
            "loadavg_start": os.getloadavg()[0]}


def finish(prov: dict) -> dict:
    """PROV with the end of the run stamped (time, load average)."""
    return {**prov, "finished": _now(), "loadavg_end": os.getloadavg()[0]}


def write_json(path: str | Path, prov: dict, **data) -> Path:
    """Write {"provenance": finish(PROV), **DATA} to PATH (its folder created: bench/results/ is
    git-ignored and absent in a fresh checkout), indented, and return the path. The one way a
    benchmark writes its JSON, so every published run carries where it came from."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"provenance": finish(prov), **data}, indent=2, default=str) + "\n")
    return path
