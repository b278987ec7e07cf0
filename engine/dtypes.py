"""The engine's dtype: names, and what "auto" resolves to on this device."""

from __future__ import annotations

import os
from functools import cache

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device, widened_bf16: bool = False) -> torch.dtype:
    """"auto" is bf16 where it pays: on CUDA (as before), on CPUs with native bf16 dot
    products (AVX512-BF16 or AMX-bf16), where oneDNN's bf16 GEMM is 3-5x its fp32 one and a
    decode step is faster at every batch size (docs/BENCHMARKS.md §8.16), and where the caller
    says the fused forward runs bf16 without them (`widened_bf16`: fused_llama.bf16_widened_here;
    the block kernel streams half of fp32's bytes and widens them in registers for fp32 FMAs;
    AVX-512 and, since 2026-12-07, AVX2-only CPUs). Elsewhere (a family the fused forward does
    not run, the SSE build) torch's bf16 matmuls are emulated and a one-token decode step runs
    tens of times slower than in fp32 (§8.2)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or native_bf16_cpu() or (device.type == "cpu" and widened_bf16):
        return torch.bfloat16
    return torch.float32


def native_bf16_cpu() -> bool:
    """Whether this CPU has bf16 dot-product instructions oneDNN uses (AVX512-BF16 or AMX)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or flags >= {"amx_bf16", "amx_tile"}


HIDE_FLAGS_ENV = "STREAMGATE_HIDE_CPU_FLAGS"    # comma-separated flags the engine acts as if absent


def cpuinfo_field(name: str) -> str | None:
    """The first value /proc/cpuinfo gives for `name` ("flags", "vendor_id", "model name"); None
    where there is none (not Linux, or no such line)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == name), None)
    except OSError:
        return None


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none: no bf16
    guess), less those STREAMGATE_HIDE_CPU_FLAGS names: a benchmark plays a lesser host with it
    (with ONEDNN_MAX_CPU_ISA and STREAMGATE_AMX=0 for what oneDNN and the kernels detect
    themselves; `bench.engine.hosts`), so the dtype, the kernel variant and the linear layers'
    forms are chosen as there."""
    hidden = {f.strip() for f in os.environ.get(HIDE_FLAGS_ENV, "").split(",") if f.strip()}
    return frozenset((cpuinfo_field("flags") or "").split()) - hidden

