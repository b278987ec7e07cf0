"""Linear layers with weights packed once at load, for eager fp32 (and bf16) on CPU.

A decode step's GEMMs have a few rows, so they are bound by reading the weights. torch's
`F.linear` on CPU calls MKL's sgemm, which streams them at ~10 GB/s and leaves the second
core idle at a few rows. Two packed forms, best first:
- "streamgate": the C++ kernel (csrc/linear.cpp), weight in 16-output column blocks; it
  streams ~17-20 GB/s on two cores: 1.5x oneDNN at 1 row, 1.7x at 8, 1.2x at 32, within 3 %
  at 128-512 (docs/BENCHMARKS.md §8.13, AMD hosts); since 2026-12-07 on linear_blocks.h's
  register tiles, every step on every CPU (Intel's ran a batched GEMM over the blocks above 4
  rows and MKL's from 128 before; the tiles beat both, 1.09-1.95x, csrc/linear.cpp);
- "onednn": where the kernel did not build, oneDNN's matmul on its own blocked layout (what
  inductor's weight prepacking and vLLM's CPU linear use): 2.1x MKL at 8 rows (§8.12).
Either differs from MKL in the last bits (another summation order), as between any two GEMM
libraries. bf16 weights (the fused Llama forward in bf16) are asked for as "onednn": with
AVX512-BF16 or AMX, oneDNN's bf16 GEMM on its packed layout is faster than any fp32 form at
8+ rows (docs/BENCHMARKS.md §8.16), but at one row it is compute-bound (~21 GFLOP/s on the
Zen 4 host, no AMX). Kind "bf16" (`Bf16Weight`), which the fused forward asks for where the C++
kernels built, runs csrc/linear_bf16.cpp's block kernel. Where that is its VDPBF16PS form (the
avx512_bf16 variant) on a CPU without AMX (`bf16_kernel_only()`) it runs every step and oneDNN's
copy is not made: one copy of the weights. On a CPU without bf16 dot products (`bf16_widened()`:
the shift+FMA form) there is one copy too and the kernel runs every step, its passes of 8 rows
over 3 blocks side by side at 45-65 % of the FMA units' peak from 8 rows up (oneDNN's emulated
bf16 GEMM is 3x slower at 300 rows; MKL's fp32 one on a widened copy, its widening included,
ties it from 128 to 512 rows, within ±10 %, and would need the scratch copy); in the avx2 build
(AVX2-only CPUs) steps of BF16_WIDE_MIN_ROWS rows or more take that GEMM (`bf16_wide_gemm`). With AMX the
kernel runs steps of up to BF16_KERNEL_MAX_ROWS rows (up to BF16_TILES_MAX_ROWS on AMX tiles)
and oneDNN's prepacked copy the rest; both copies are held, so only while the model's linear
weights are at most BF16_BLOCK_COPY_MAX_BYTES (2 GiB of bf16: a ~1B-parameter model). The
measurements behind the splits: docs/ENGINE.md ("The forward pass") and docs/BENCHMARKS.md §10
(`gemm-crossover`).
A third kind, "int8", holds int8 weight-only codes in the kernel's block layout
(quantization.py, csrc/linear_int8.cpp) where `EngineConfig.quantization` is "int8".
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import elastic
from .dtypes import cpu_flags, native_bf16_cpu
from .huge_pages import Arena
from .kernels import amx_linear_rows, load_kernels, loaded_variant
from .quantization import Int8Linear, Int8Weight, in_slices, quantize_linears

log = logging.getLogger("streamgate.engine")

BF16_KERNEL_MAX_ROWS = 4       # bf16 with both copies: the block kernel up to here, oneDNN above (measured)
BF16_WIDE_MIN_ROWS = 80        # bf16 in the avx2 build: its tiles below, MKL's fp32 GEMM on the widened blocks from here
BF16_TILES_MAX_ROWS = 64       # bf16 on AMX: the block copy on AMX tiles from 5 rows to here, oneDNN above
BF16_BLOCK_COPY_MAX_BYTES = 2 << 30     # a second (block) copy doubles bf16 linear bytes: only up to this much extra


def bf16_kernel_only() -> bool:
    """Whether the bf16 block kernel runs steps of every size and oneDNN's copy is not kept:
    its VDPBF16PS form (the avx512_bf16 variant) on a CPU without AMX, where it measured at
    least oneDNN's prepacked bf16 matmul from 1 to 512 rows, or with AMX on the elastic pool
    (elastic.py: torch's operators, oneDNN's included, on one thread). Otherwise (AMX: oneDNN's
    tiles) oneDNN keeps the steps above BF16_KERNEL_MAX_ROWS; without AVX512-BF16 the shift+FMA
    form runs every step (bf16_widened)."""
    return (load_kernels() and loaded_variant() == "avx512_bf16"
            and ("amx_bf16" not in cpu_flags() or elastic.pool_threads() > 1))


def bf16_widened() -> bool:
    """Whether the shift+FMA block kernel runs every bf16 step and oneDNN's copy is not made: a
    CPU without bf16 dot products (no AVX512-BF16, no AMX; dtypes.native_bf16_cpu), where oneDNN
    emulates its bf16 GEMM. SmolLM2's 120 layer linears on the Intel Ice Lake host (avx512
    build, 2 threads, 2026-12-07; oneDNN bf16 / the kernel's passes of 4 rows over one block /
    MKL's fp32 GEMM on a widened copy, widening included / the kernel's register tiles, 8 rows
    over 3 blocks, three runs alternating with the 4-row form): 8 rows 45.2 / 21.1-23.7 / 45.4
    / 13.3-16.1 ms, 32 rows 129.5 / 57.5-60.2 / 82-98 / 38.0-44.4, 300 rows 1,027 / 481-615 /
    335-350 / 312-400."""
    return load_kernels() and not native_bf16_cpu()


def bf16_wide_gemm() -> bool:
    """Whether bf16 steps of BF16_WIDE_MIN_ROWS rows or more run MKL's fp32 GEMM on the blocks
    widened into a scratch buffer (plain_gemm): the avx2 build without bf16 dot products, whose
    tiles (6 rows over one block in AVX2's 16 registers) trail it on many rows. SmolLM2's 120
    layer linears, bf16, 2 threads, played on the Intel Ice Lake host with bench.engine.hosts'
    avx2 flags and MKL at AVX2 (2026-12-07; kernel / widened GEMM, widening included): 32 rows
    79 / 120 ms, 64 rows 139 / 151, 96 rows 199 / 189, 128 rows 291 / 260, 300 rows 708 / 543,
    512 rows 1,067 / 741."""
    return bf16_widened() and loaded_variant() == "avx2"


def plain_gemm(x2: torch.Tensor, blocks: torch.Tensor, bias32: torch.Tensor | None, N: int) -> torch.Tensor:
    """x2 [M, K] @ W^T + b as fp32 GEMMs on the plain layout: W's blocks [ceil(N/16), K, 16]
    (bf16 widened, exactly; fp32 as they are), a slice at a time (quantization.in_slices)
    transposed into this thread's fp32 scratch [K, n]; the bias added in fp32, each sum rounded
    once to x2's dtype. Steps of many rows in the avx2 build, where the library's GEMM on one
    plain [K, n] operand beats the bf16 kernel's AVX2 tiles (bf16_wide_gemm())."""
    K = blocks.shape[1]

    def gemm(n0: int, n1: int, buf: torch.Tensor) -> torch.Tensor:
        part = blocks[n0 // 16:-(-n1 // 16)]
        wide = buf[:part.numel()].view(K, part.shape[0], 16)
        wide.copy_(part.permute(1, 0, 2))
        w = wide.view(K, -1)[:, :n1 - n0]
        y = torch.mm(xf, w) if bias32 is None else torch.addmm(bias32[n0:n1], xf, w)
        return y if y.dtype == x2.dtype else y.to(x2.dtype)

    with elastic.library_gemm():         # bf16 on the elastic pool: torch's threads for MKL meanwhile
        xf = x2.float()
        return in_slices(N, K, torch.float32, lambda n: -(-n // 16) * 16 * K, gemm)


class Bf16Weight:
    """A bf16 weight packed for csrc/linear_bf16.cpp's block kernel (bf16 x bf16 products
    exact, fp32 accumulation; VDPBF16PS k-pairs with AVX512-BF16, else widened by a shift
    for fp32 FMAs) and, unless bf16_kernel_only() or bf16_widened(), oneDNN's prepacked layout
    for steps of more than BF16_KERNEL_MAX_ROWS rows (`onednn`, else None). All round the fp32
    sum once to the activations' dtype. Holding both doubles the bf16 weight bytes; the single-copy
    alternative for that case (the blocks unpacked into a scratch buffer for torch's bf16
    GEMM, as the int8 path dequantizes) took 1.2x oneDNN's time at 512 rows and 2-5x at 8-32
    (batched decode) on the Zen 4 host (2026-12-02), oneDNN reordering a plain weight on
    every call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int = 8):
        self.out_features, self.in_features = weight.shape
        self.blocks = torch.ops.streamgate.pack_bf16(weight.contiguous())
        self.onednn = (None if bf16_kernel_only() or bf16_widened()
                       else torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint))
        self.wide_gemm = bf16_wide_gemm()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.bias32 = None if bias is None else self.bias.float().contiguous()          # the kernel's

    @property
    def nbytes(self) -> int:
        """Bytes held by the block copy and the biases (oneDNN's copy, where `onednn` holds
        one, is opaque: as many again)."""
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.bias, self.bias32) if t is not None)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)                      # [M, K]
        rows = x2.shape[0]
        # AMX tiles (csrc/linear_amx.h) run the block copy in place: SmolLM2's 120 layer linears,
        # Intel AMX host, weights in cache, 5.5 against oneDNN's 6.7 ms at 8 rows, 6.4 against 7.7
        # at 32, 9.8 against 10.2 at 64, 59.5 against 51.5 at 512 (so oneDNN above 64).
        if self.wide_gemm and rows >= BF16_WIDE_MIN_ROWS:
            y = plain_gemm(x2, self.blocks, self.bias32, self.out_features)
        elif self._on_blocks(x2):
            y = torch.ops.streamgate.linear_bf16(x2, self.blocks, self.bias32, self.out_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.onednn, self.bias, "none", [], "")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _on_blocks(self, x2: torch.Tensor) -> bool:
        """Whether linear() runs these rows [M, K] on the block copy (else oneDNN's)."""
        return self.onednn is None or x2.shape[0] <= BF16_KERNEL_MAX_ROWS or self._on_tiles(x2)

    def _on_tiles(self, x2: torch.Tensor) -> bool:
        """Whether linear() runs these rows [M, K] on the block copy's AMX tiles: past 4 rows
        (csrc/linear_bf16.cpp's kAmxMinRows, BF16_KERNEL_MAX_ROWS here), up to
        BF16_TILES_MAX_ROWS where oneDNN's copy is held."""
        rows = x2.shape[0]
        return (rows > BF16_KERNEL_MAX_ROWS and (self.onednn is None or rows <= BF16_TILES_MAX_ROWS)
                and amx_linear_rows(x2))

    def silu_linear(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [M, N / 2] of a gate/up weight packed alternating in blocks of 16
        (fused_pack.silu_block): in one pass, the GEMM's epilogue applying SiLU·up
        (csrc/linear_amx.h on AMX tiles, csrc/linear_dp.h's VDPBF16PS passes), wherever linear()
        would run the block copy on bf16 rows in the avx512_bf16 build; else linear() then
        silu_and_mul(block=16). The same bits either way."""
        if x.dtype == torch.bfloat16 and loaded_variant() == "avx512_bf16" and self._on_blocks(x):
            return torch.ops.streamgate.linear_bf16_silu(x, self.blocks, self.bias32, self.out_features)
        return torch.ops.streamgate.silu_and_mul(self.linear(x), 16)


class PackedLinear(nn.Module):
    """`nn.Linear` whose weight is kept only in packed layouts (`kind`: streamgate, onednn,
    bf16 or int8)."""

    def __init__(self, linear: nn.Linear, kind: str = "streamgate", rows_hint: int = 8):
        super().__init__()
        self.in_features, self.out_features, self.kind = linear.in_features, linear.out_features, kind
        weight = linear.weight.detach()
        with torch.no_grad():
            if kind == "bf16" and not (weight.dtype == torch.bfloat16 and load_kernels()):
                kind = self.kind = "onednn"         # the block kernel needs bf16 weights and the C++ kernels
            if kind == "int8":                   # holds the bias itself (an fp32 copy for its kernel)
                self.packed = Int8Weight(weight, linear.bias)
            elif kind == "bf16":
                self.packed = Bf16Weight(weight, linear.bias, rows_hint)
            elif kind == "streamgate":
                self.packed = torch.ops.streamgate.pack_linear(weight)
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        self.bias = None if linear.bias is None or kind in ("int8", "bf16") else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [..., in] -> [..., out]
        if self.kind in ("int8", "bf16"):
            return self.packed.linear(x)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = torch.ops.streamgate.linear(x.reshape(-1, self.in_features), self.packed, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    linear = forward                      # as Int8Weight / Bf16Weight call it (the fused forward)


def available() -> str | None:
    """The best packed form here: "streamgate", "onednn", or None."""
    if load_kernels():
        return "streamgate"
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "onednn"
    return None


def pack_linears(model: nn.Module, kind: str) -> int:
    """Replace every fp32 `nn.Linear` of `model` (on CPU) by a `PackedLinear`; returns how
    many. A tied lm_head gets its own packed copy; the embedding keeps the original."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and mod.weight.dtype == torch.float32 and mod.weight.device.type == "cpu"]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, PackedLinear(mod, kind))
    log.info("linear layers: %d packed (%s)", len(targets), kind)
    return len(targets)


def _stream(module: nn.Module) -> tuple[object, str] | None:
    """(holder, attribute) of the packed tensor a linear's kernel streams at each step, or None
    (not a packed linear, or oneDNN's opaque copy)."""
    weight = module.weight_int8 if isinstance(module, Int8Linear) else getattr(module, "packed", None)
    if isinstance(weight, Int8Weight):
        return weight, "codes"
    if isinstance(weight, Bf16Weight):
        return weight, "blocks"
    if isinstance(module, PackedLinear) and module.kind == "streamgate":
        return module, "packed"
    return None


def arrange(modules) -> int:
    """Move the packed weights of `modules` (in the order a step calls them; others skipped)
    into one huge-page region in that order (huge_pages.py); returns the bytes moved. Each is
    let go as soon as it is copied, so loading holds one weight twice at most, not all of them."""
    holders = [s for s in dict.fromkeys(_stream(m) for m in modules) if s is not None]
    sizes = [getattr(holder, name).numel() * getattr(holder, name).element_size() for holder, name in holders]
    arena = Arena(sizes)
    for i, (holder, name) in enumerate(holders):
        setattr(holder, name, arena.copy(i, getattr(holder, name)))
    return sum(sizes)


def maybe_pack(model: nn.Module, config, device: torch.device, dtype: torch.dtype) -> bool:
    """Pack for eager fp32 on CPU in one process, unless `config.packed_linear` is False
    (a compiled model is left to inductor; tensor-parallel shards are DTensors). With
    `config.quantization` "int8" every linear becomes int8 weight-only, whatever the dtype."""
    if getattr(config, "quantization", None) == "int8":
        packed = quantize_linears(model) > 0
    elif config.packed_linear is False or config.compile or config.tensor_parallel_size > 1:
        return False
    elif not (device.type == "cpu" and dtype == torch.float32 and (kind := available())):
        return False
    else:
        packed = pack_linears(model, kind) > 0
    if packed and config.huge_pages:
        arrange(model.modules())        # module order: a decoder layer's linears, layer by layer
    return packed
