"""The engine's C++ kernels (csrc/), built from source with torch's extension tools.

The kernels are written once and compiled once per instruction-set variant (as llama.cpp
builds a backend per CPU level and vLLM detects the CPU's ISA): a variant is picked at load
from the CPU's flags, so a venv built on one host runs on another (a container image, a
shared cache) without an illegal instruction or a needlessly slow path. `make setup` builds
every variant of this architecture (`python -m engine.kernels`); the engine then only loads
the one for its CPU, building it first if the sources changed. Where no compiler is
available the build fails with its log and the engine keeps its pure-torch attention
(attention.py) and oneDNN linear layers (packed_linear.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .dtypes import cpu_flags, cpuinfo_field
from .models import cache_dir

log = logging.getLogger("streamgate.engine")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "linear.cpp", CSRC / "linear_int8.cpp", CSRC / "linear_bf16.cpp",
           CSRC / "layers.cpp", CSRC / "llama_layers.cpp",
           CSRC / "write_kv.cpp", CSRC / "parallel.cpp", CSRC / "logits.cpp"]
HEADERS = sorted(CSRC.glob("*.h"))
NAME = "streamgate_kernels"
ISA_ENV = "STREAMGATE_KERNEL_ISA"       # force a variant by name (tests, benchmarks)


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: the compiler's target flags and the CPU flags (as
    /proc/cpuinfo names them) a CPU needs to run it. Best first in VARIANTS."""

    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]

    def runs_here(self, flags: frozenset[str]) -> bool:
        return self.needs <= flags


# x86-64 microarchitecture levels (the psABI's v3 = Haswell's AVX2/FMA/BMI, v4 = AVX-512
# F/BW/CD/DQ/VL) plus AVX512-BF16, whose dot products the bf16 attention uses
# (csrc/attention_bf16.h, attention_decode_bf16.h), with AVX512-VNNI (every CPU with AVX512-BF16
# has it: Cooper Lake, Sapphire Rapids on, Zen 4 on), whose VPDPBUSD the int8 linears' bf16 rows
# use (csrc/linear_vnni.h). avx512_vnni is the same for CPUs with VNNI and no AVX512-BF16
# (Cascade Lake, Ice Lake, Tiger Lake): SmolLM2's int8 decode step on the Intel Ice Lake host
# (2 threads, VNNI switched on and off every 10 steps, 2026-12-07) took 8.1-9.9 ms on VNNI
# against 8.8-11.6 on the FMA tiles at one row, 10.3-10.9 against 11.5-12.7 at 4, level at 8-32
# rows. An AMX host runs the avx512_bf16 build,
# whose prefill attention tiles use AMX where the CPU has AMX-BF16 and Linux grants the tile
# state (csrc/attention_amx.h: functions compiled for the AMX target, chosen at run time, so no
# variant of its own); oneDNN uses AMX for the bf16 matmuls by itself.
# -mtune=native only orders instructions for the build host; it never adds any.
_V3 = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86_VARIANTS = (
    Variant("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=native"),
            _V4 | {"avx512_bf16", "avx512_vnni"}),
    Variant("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=native"), _V4 | {"avx512_vnni"}),
    Variant("avx512", ("-march=x86-64-v4", "-mtune=native"), _V4),
    Variant("avx2", ("-march=x86-64-v3", "-mtune=native"), _V3),
    Variant("x86_64", ("-march=x86-64-v2", "-mtune=native"), frozenset({"sse4_2", "popcnt"})),
)
# Elsewhere (aarch64, ...): one build for the host it is built on.
NATIVE = Variant("native", ("-march=native",), frozenset())


def variants() -> tuple[Variant, ...]:
    """The variants of this machine's architecture, best first."""
    return X86_VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else (NATIVE,)


def built_at_setup() -> tuple[Variant, ...]:
    """What `make setup` builds: every variant of this architecture, so the venv runs on any
    CPU of it (about a minute each on two cores)."""
    return variants()


def choose_variant(flags: frozenset[str] | None = None) -> Variant:
    """The best variant this CPU runs, or the one STREAMGATE_KERNEL_ISA names (refused if
    this CPU cannot run it: an illegal instruction would kill the process)."""
    flags = cpu_flags() if flags is None else flags
    runnable = [v for v in variants() if v.runs_here(flags)] or [variants()[-1]]
    if wanted := os.environ.get(ISA_ENV):
        named = {v.name: v for v in variants()}
        if wanted not in named:
            raise ValueError(f"{ISA_ENV}={wanted!r}: the variants are {', '.join(named)}")
        if named[wanted] not in runnable:
            missing = sorted(named[wanted].needs - flags)
            raise ValueError(f"{ISA_ENV}={wanted!r}: this CPU lacks {', '.join(missing)}")
        return named[wanted]
    return runnable[0]


def build_dir(variant: Variant | None = None) -> Path:
    """Where a variant is built: beside the interpreter it is built for (the venv's
    `share/streamgate/kernels/<variant>`), so every process of that venv, whatever its
    STREAMGATE_CACHE (tests give servers fresh caches), loads the one `make setup` built.
    Outside a writable prefix, the cache directory; STREAMGATE_KERNEL_DIR overrides both."""
    prefix = Path(sys.prefix) / "share" / "streamgate"
    if override := os.environ.get("STREAMGATE_KERNEL_DIR"):
        path = Path(override)
    elif os.access(prefix if prefix.exists() else sys.prefix, os.W_OK):
        path = prefix / "kernels"
    else:
        path = cache_dir() / "kernels"
    path = path / (variant or choose_variant()).name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def builder(directory: Path) -> Iterator[None]:
    """Held by a process while it builds or loads the kernels in `directory`: an exclusive
    flock, which the OS drops when its holder exits or is killed. Its holder knows that no
    live process is building there, so torch's own `lock` file (the baton `cpp_extension`
    waits on, with no timeout), if present, was left by a build that was killed: it is
    removed instead of waited on. Until 2026-12-06 only a baton older than 15 minutes was,
    and a load after a killed build waited that long."""
    import fcntl

    with open(directory / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        baton = directory / "lock"
        if baton.exists():
            log.warning("removing %s, left by a kernel build that was killed", baton)
            baton.unlink(missing_ok=True)
        yield


def build(variant: Variant, load_it: bool) -> bool:
    """Compile `variant` (ninja rebuilds only what its sources or flags changed) and, if
    `load_it`, load it as torch operators in the `streamgate` namespace. A process loads one
    variant at most, and never one its CPU cannot run: a library's static initializers are
    compiled for its target too."""
    # cpp_extension runs `ninja` from PATH; the venv's own (the `ninja` package) is there only
    # when the venv is activated, which `make` does not do.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    # Each variant has its own library name: torch remembers loaded libraries by name.
    path = build_dir(variant)
    name, directory = f"{NAME}_{variant.name}", str(path)
    cflags = ["-O3", *variant.cflags, "-fno-math-errno", "-fopenmp", _headers_flag()]
    verbose = os.environ.get("STREAMGATE_VERBOSE_BUILD") == "1"
    start = time.perf_counter()
    try:
        with builder(path):
            _build(name, directory, cflags, verbose, load_it)
    except Exception as e:  # noqa: BLE001 (no compiler, bad toolchain: fall back, say why)
        log.warning("C++ kernels (%s) did not build (%s); using the torch paths", variant.name, e)
        return False
    log.info("C++ kernels (%s) %s in %.1f s", variant.name, "ready" if load_it else "built",
             time.perf_counter() - start)
    return True


def _build(name: str, directory: str, cflags: list[str], verbose: bool, load_it: bool) -> None:
    """build()'s compile (and load), with builder() held."""
    from torch.utils import cpp_extension

    if load_it:
        # is_python_module=False: loaded with torch.ops.load_library, so the operators are
        # called through the dispatcher (a few us) rather than a Python wrapper.
        cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], build_directory=directory,
                           extra_cflags=cflags, extra_ldflags=["-fopenmp"], is_python_module=False,
                           verbose=verbose)
        return
    # The same ninja file and build that load() makes, without loading the result (torch has
    # no public build-only entry point); builder() already keeps other processes out.
    cpp_extension._write_ninja_file_and_build_library(
        name, [str(p) for p in SOURCES], cflags, None, None, ["-fopenmp"], None, directory, verbose,
        with_cuda=False, with_sycl=False)


@cache
def load_kernels() -> bool:
    """Build (if the sources changed) and load the variant for this CPU as torch operators
    in the `streamgate` namespace (`torch.ops.streamgate.paged_attention`, `.pack_linear`,
    `.linear`, ...); False if it cannot be built."""
    import torch

    if missing := [str(p) for p in SOURCES if not p.exists()]:
        log.warning("C++ kernels: %s missing; using the torch paths", ", ".join(missing))
        return False
    variant = choose_variant()
    log.info("C++ kernels: the %s variant (CPU %s)", variant.name, _cpu_model())
    if not build(variant, load_it=True):
        return False
    _register_fakes(torch)
    return True


def amx_linear_rows(x2) -> bool:
    """Whether the linear kernels run these rows [M, K] on AMX tiles (csrc/linear_amx.h) once
    past their row minimum: bf16 rows, K % 32 == 0, and AMX on for this process
    (`torch.ops.streamgate.amx_tiles()`: the CPU and Linux allow it, STREAMGATE_AMX is not 0, no
    call turned it off). The C++ ops check the same; callers use it to pick the op over oneDNN."""
    import torch

    return x2.dtype == torch.bfloat16 and x2.shape[-1] % 32 == 0 and torch.ops.streamgate.amx_tiles()


def logits_fp32(x):
    """A step's logits [K, V] as fp32: bf16 ones on the CPU through csrc/logits.cpp, on the
    step's threads (served, torch's own `float()` runs on one: 0.9 ms of a 32-row SmolLM2 step
    on the Intel AMX host); the same values either way."""
    import torch

    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and load_kernels():
        return torch.ops.streamgate.logits_fp32(x)
    return x.float()


@cache
def loaded_variant() -> str | None:
    """The name of the variant this process runs, or None without kernels: fixed once loaded
    (load_kernels is cached), so asked once (choosing again took ~2 us, and Bf16Weight.silu_linear
    and Int8Weight.linear ask on every call)."""
    return choose_variant().name if load_kernels() else None


def _cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or "?"


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


def build_all() -> bool:
    """`make setup`: compile every variant of built_at_setup() (and this CPU's, if it is not
    among them), then load this CPU's. True if this CPU's variant is ready."""
    mine = choose_variant()
    for variant in built_at_setup():
        if variant != mine:
            build(variant, load_it=False)
    return load_kernels()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if build_all() else 1)
