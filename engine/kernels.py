"""The engine's C++ kernels (csrc/), built from source with torch's extension tools.

`make setup` builds them once (`python -m engine.kernels`); the engine then only loads the
built library, rebuilding it if the source changed. Where no compiler is available the build
fails with its log and the engine keeps its pure-torch attention (attention.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from functools import cache
from pathlib import Path

from .models import cache_dir

log = logging.getLogger("streamgate.engine")

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "paged_attention.cpp"
NAME = "streamgate_paged_attention"
SCHEMA = ("(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor q_start, Tensor ctx_lens, "
          "int block_size, float scale, Tensor(a!) out) -> ()")


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
def paged_attention_ops():
    """The compiled module (its `paged_attention` function), or None if it cannot be built."""
    from torch.utils.cpp_extension import load

    if not SOURCE.exists():
        log.warning("paged attention kernel: %s is missing; using the torch attention path", SOURCE)
        return None
    # cpp_extension runs `ninja` from PATH; the venv's own (the `ninja` package) is there only
    # when the venv is activated, which `make` does not do.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    start = time.perf_counter()
    try:
        module = load(name=NAME, sources=[str(SOURCE)], build_directory=str(build_dir()),
                      extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"],
                      verbose=os.environ.get("STREAMGATE_VERBOSE_BUILD") == "1")
    except Exception as e:  # noqa: BLE001 (no compiler, bad toolchain: fall back, say why)
        log.warning("paged attention kernel did not build (%s); using the torch attention path", e)
        return None
    log.info("paged attention kernel ready in %.1f s", time.perf_counter() - start)
    return module


@cache
def paged_attention_op():
    """The kernel as a torch custom op (`torch.ops.streamgate.paged_attention`), so that
    torch.compile keeps it as one opaque call instead of breaking the graph; None if unbuilt."""
    import torch

    module = paged_attention_ops()
    if module is None:
        return None

    @torch.library.custom_op("streamgate::paged_attention", mutates_args=("out",), schema=SCHEMA)
    def paged_attention(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, out):
        module.paged_attention(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, out)

    @paged_attention.register_fake
    def _(q, k_pool, v_pool, block_tables, q_start, ctx_lens, block_size, scale, out) -> None:
        return None

    return paged_attention


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if paged_attention_ops() is not None else 1)
