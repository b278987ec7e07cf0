"""The engine's C++ kernels (csrc/), built from source with torch's extension tools.

`make setup` builds them once (`python -m engine.kernels`); the engine then only loads the
built library, rebuilding it if the source changed. Where no compiler is available the build
fails with its log and the engine keeps its pure-torch attention (attention.py) and
oneDNN linear layers (packed_linear.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from functools import cache
from pathlib import Path

from .models import cache_dir

log = logging.getLogger("streamgate.engine")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "linear.cpp", CSRC / "layers.cpp"]
HEADERS = sorted(CSRC.glob("*.h"))
NAME = "streamgate_kernels"


# A build holds torch's `lock` file for about a minute; one older than this was left by a
# build that was killed, and would make every later load wait on it forever.
_STALE_LOCK_S = 900.0


def build_dir() -> Path:
    """Where the kernel is built: beside the interpreter it is built for (the venv's
    `share/streamgate/kernels`), so every process of that venv, whatever its
    STREAMGATE_CACHE (tests give servers fresh caches), loads the one `make setup` built.
    Outside a writable prefix, the cache directory; STREAMGATE_KERNEL_DIR overrides both."""
    prefix = Path(sys.prefix) / "share" / "streamgate"
    if override := os.environ.get("STREAMGATE_KERNEL_DIR"):
        path = Path(override)
    elif os.access(prefix if prefix.exists() else sys.prefix, os.W_OK):
        path = prefix / "kernels"
    else:
        path = cache_dir() / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        log.warning("removing a stale kernel build lock %s (a build was killed)", lock)
        lock.unlink(missing_ok=True)
    return path


@cache
def load_kernels() -> bool:
    """Build (if the sources changed) and load the kernels as torch operators in the
    `streamgate` namespace (`torch.ops.streamgate.paged_attention`, `.pack_linear`, `.linear`);
    False if they cannot be built."""
    import torch
    from torch.utils.cpp_extension import load

    if missing := [str(p) for p in SOURCES + HEADERS if not p.exists()]:
        log.warning("C++ kernels: %s missing; using the torch paths", ", ".join(missing))
        return False
    # cpp_extension runs `ninja` from PATH; the venv's own (the `ninja` package) is there only
    # when the venv is activated, which `make` does not do.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    start = time.perf_counter()
    try:
        # is_python_module=False: the library is loaded with torch.ops.load_library, so its
        # operators are called through the dispatcher (a few us) rather than a Python wrapper.
        load(name=NAME, sources=[str(p) for p in SOURCES], build_directory=str(build_dir()),
             extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp", _headers_flag()],
             extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=os.environ.get("STREAMGATE_VERBOSE_BUILD") == "1")
    except Exception as e:  # noqa: BLE001 (no compiler, bad toolchain: fall back, say why)
        log.warning("C++ kernels did not build (%s); using the torch paths", e)
        return False
    _register_fakes(torch)
    log.info("C++ kernels ready in %.1f s", time.perf_counter() - start)
    return True


def _headers_flag() -> str:
    """A define carrying the headers' hash: torch rebuilds when the sources or the flags
    change, and does not read the headers they include."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in HEADERS)).hexdigest()[:16]
    return f"-DSTREAMGATE_HEADERS={digest}"


def _register_fakes(torch) -> None:
    """Shapes for torch.compile, which traces the operators without running them."""
    @torch.library.register_fake("streamgate::paged_attention")
    def _(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, out) -> None:
        return None

    @torch.library.register_fake("streamgate::linear")
    def _(x, packed, bias, out_features):
        return x.new_empty((x.shape[0], out_features))


def paged_attention_ops():
    """`torch.ops.streamgate` once the kernels are loaded (its `paged_attention`), or None."""
    import torch

    return torch.ops.streamgate if load_kernels() else None


def paged_attention_op():
    """`torch.ops.streamgate.paged_attention` (one opaque call under torch.compile), or None."""
    ops = paged_attention_ops()
    return None if ops is None else ops.paged_attention


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if load_kernels() else 1)
