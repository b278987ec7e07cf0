"""int8 weight-only linear layers (`EngineConfig.quantization="int8"`), applied once at load.

Each output channel n of a weight W [N, K] gets a symmetric scale s_n = max_k |W[n, k]| / 127
and int8 codes q = round(W / s_n), so the weight's bytes are halved against bf16 (a quarter
of fp32) and a decode step, bound by reading them, reads half as much. Only the codes (packed
as csrc/linear.cpp packs fp32 weights, [ceil(N/16), K, 16]) and the fp32 scales are kept; the
error against the unquantized layer is bounded per output by |W - q s| <= s_n / 2 elementwise:
|y_n - y_q,n| <= s_n / 2 * sum_k |x_k| (plus the activation dtype's rounding);
tests/test_quantization.py checks exactly that. Two paths compute the same y = x (q s)^T + b:
- steps of up to `KERNEL_MAX_ROWS` rows (decode, speculative verification): the C++ kernel
  (csrc/linear_int8.cpp) widens the codes to fp32 in registers, FMAs them with the
  activations (converted to fp32 once per call), accumulates in fp32 and applies s and b at
  the end: it reads one byte per weight;
- steps of more rows (a prefill chunk): the codes are dequantized, a slice of at most
  `SCRATCH_ELEMENTS` weights at a time, into one scratch buffer of the activations' dtype
  (per thread, reused by every layer) and the dtype's GEMM runs on it (oneDNN for bf16). A
  512-row GEMM costs far more than dequantizing its weight, and no dequantized copy is held.
  In the avx512_bf16 build, bf16 steps dequantize into pack_bf16's layout instead
  (`dequantize_int8_bf16`: the same bf16 weights) and run the bf16 block kernel, which beats
  oneDNN there and runs on the elastic pool (elastic.py), so int8 is served on it too. On a
  CPU without bf16 dot products (dtypes.native_bf16_cpu) bf16 steps dequantize into fp32 and
  run the fp32 GEMM, rounding its sums once to bf16: oneDNN's bf16 GEMM is emulated there. Zen 4
  host (2026-12-06, one process, 2 threads): a 286-token prefill step beside 7 decode rows
  203 -> 183.5 ms (median of 8, alternating: oneDNN on the dequantized copy, then the block kernel).
- bf16 steps of more than eight rows where the CPU has AMX (`torch.ops.streamgate.amx_tiles()`)
  and K % 32 == 0, prefill chunks included: the same op runs them on AMX tiles
  (csrc/linear_amx.h), widening the codes to bf16 once per call into a small panel per 32
  outputs; products exact, fp32 sums in another order, scale and bias at the end as the
  kernel does. Intel AMX host (2026-12-04, 2 threads): a 32-row decode step 38 ms against 60
  on the kernel (bf16: 42-44), a 512-token prefill step 113-114 ms against 126-131 dequantized.
The kernel keeps q s in fp32, the GEMM path rounds it once to the activations' dtype: in fp32
the two differ in summation order only, in bf16 also by that rounding (as two GEMM libraries'
results do), so a bf16 sequence's tokens may depend on whether a step had more than 32 rows.
Measured on the Zen 4 development host (2026-12-02, shared, one thread): the kernel runs at
~40 G MACs/s cache-resident (fp32 linear.cpp: ~30); over SmolLM2's decoder weights (out of cache)
it beats dequantize + GEMM up to 16 rows by 1.6-10x and ties it at 32-48 rows, hence the
crossover; dequantizing costs ~0.17 ns a weight (0.3 ms for the fused gate/up, 3 % of its
512-row GEMM, which on the unpacked weight took the time of oneDNN's prepacked one).
Whole-step numbers: docs/BENCHMARKS.md §10 (`python -m bench.engine.int8`).
Without the C++ kernels (no compiler) every step takes the dequantizing path on unpacked codes.
torch's `aten._weight_int8pack_mm`, used before, was compute-bound here (about 4 G MACs/s, a
one-row decode step 1.1-1.4x bf16) and needed the dequantized copy for every other step.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from . import elastic
from .dtypes import native_bf16_cpu
from .kernels import amx_linear_rows, load_kernels, loaded_variant

log = logging.getLogger("streamgate.engine")

KERNEL_MAX_ROWS = 32           # the kernel up to here, dequantize + GEMM above (measured crossover, above)
SCRATCH_ELEMENTS = 1 << 22     # the largest slice dequantized at once (8 MB in bf16): an lm_head is split
_BLOCK = 16                    # outputs per packed block (csrc/linear_int8.cpp)
_scratch = threading.local()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (codes [N, K] int8, scales [N] fp32)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0      # [N]
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)              # [N, K]
    return codes.contiguous(), scales


def scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """This thread's scratch buffer of `dtype`, at least `numel` elements (grown, never shrunk)."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        # A normal tensor, whatever mode the first caller ran in: one made under inference_mode
        # (the engine's steps) cannot be written in place outside it (a test, a hook, no_grad).
        with torch.inference_mode(False):
            buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def in_slices(N: int, K: int, dtype: torch.dtype, elements, gemm) -> torch.Tensor:
    """gemm(n0, n1, buf) for output slices [n0, n1) of an N x K weight, at most SCRATCH_ELEMENTS
    weights each (whole blocks of 16 outputs), buf this thread's scratch buffer of `dtype`, at
    least elements(n) for the widest slice; the pieces side by side. A layer's weight is
    dequantized (int8) or widened (bf16 blocks in the avx2 build, packed_linear.plain_gemm) a slice at a time into it."""
    step = max(_BLOCK, SCRATCH_ELEMENTS // K // _BLOCK * _BLOCK)
    buf = scratch(dtype, elements(min(N, step)))
    pieces = [gemm(n0, min(N, n0 + step), buf) for n0 in range(0, N, step)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


class Int8Weight:
    """An int8 weight (packed codes), its per-channel scales and bias; `linear` runs it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        codes, self.scales = quantize_int8(weight)
        self.out_features, self.in_features = codes.shape
        self.dtype = weight.dtype
        self.kernel = load_kernels()
        self.codes = torch.ops.streamgate.pack_int8(codes) if self.kernel else codes   # [ceil(N/16), K, 16] or [N, K]
        self.bias = None if bias is None else bias.detach().contiguous()
        self.bias32 = None if bias is None else self.bias.float().contiguous()          # the kernel's

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and bias."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.bias, self.bias32)
                   if t is not None)

    def dequantized(self, dtype: torch.dtype, rows: tuple[int, int] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """q * s (rounded once to `dtype`) for output rows [n0, n1) (all by default), transposed:
        [K, n1 - n0], written into `out` if given."""
        n0, n1 = rows or (0, self.out_features)
        if out is None:
            out = torch.empty(self.in_features, n1 - n0, dtype=dtype)
        if self.kernel:                      # whole packed blocks: n0 is a multiple of 16
            assert n0 % _BLOCK == 0, n0
            torch.ops.streamgate.dequantize_int8(self.codes[n0 // _BLOCK:-(-n1 // _BLOCK)], self.scales[n0:n1], out)
        else:
            torch.mul(self.codes[n0:n1].t(), self.scales[n0:n1], out=out)
        return out

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)                      # [M, K]
        # Past KERNEL_MAX_ROWS the kernel still takes the step where it runs it on AMX tiles: there
        # it ties dequantize + GEMM at 512 rows (SmolLM2's layers: 60.8 against 61.6 ms) without
        # the scratch copy, and is 3-4x faster from 32 to 128 rows.
        if self.kernel and (x2.shape[0] <= KERNEL_MAX_ROWS or amx_linear_rows(x2)):
            y = torch.ops.streamgate.linear_int8(x2, self.codes, self.scales, self.bias32, self.out_features)
        elif self.kernel and x2.dtype == torch.bfloat16 and loaded_variant() == "avx512_bf16":
            y = self._dequantized_blocks(x2)
        elif x2.dtype == torch.bfloat16 and not native_bf16_cpu():     # oneDNN would emulate a bf16 GEMM
            with elastic.library_gemm():
                y = self._dequantized_gemm(x2.float()).to(x2.dtype)
        else:
            y = self._dequantized_gemm(x2)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _dequantized_blocks(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 @ (q s)^T + b on the bf16 block kernel (linear_bf16), each slice dequantized into
        its packed layout (pack_bf16's) in the scratch buffer."""
        pairs = (self.in_features + 1) // 2

        def size(n: int) -> int:                 # whole blocks of 16 outputs, k in pairs
            return -(-n // _BLOCK) * pairs * _BLOCK * 2

        def gemm(n0: int, n1: int, buf: torch.Tensor) -> torch.Tensor:
            blocks = buf[:size(n1 - n0)].view(-1, pairs, _BLOCK, 2)
            torch.ops.streamgate.dequantize_int8_bf16(self.codes[n0 // _BLOCK:-(-n1 // _BLOCK)], self.scales[n0:n1],
                                                      blocks)
            bias = None if self.bias32 is None else self.bias32[n0:n1]
            return torch.ops.streamgate.linear_bf16(x2, blocks, bias, n1 - n0)

        return self._in_slices(x2, size, gemm)

    def _dequantized_gemm(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 @ (q s)^T + b through the scratch buffer: each slice dequantized transposed, then
        the dtype's GEMM."""
        K = self.in_features
        bias = None if self.bias is None else self.bias.to(x2.dtype)

        def gemm(n0: int, n1: int, buf: torch.Tensor) -> torch.Tensor:
            wt = self.dequantized(x2.dtype, (n0, n1), buf[:(n1 - n0) * K].view(K, n1 - n0))    # [K, n]
            return torch.mm(x2, wt) if bias is None else torch.addmm(bias[n0:n1], x2, wt)

        return self._in_slices(x2, lambda n: n * K, gemm)

    def _in_slices(self, x2: torch.Tensor, elements, gemm) -> torch.Tensor:
        return in_slices(self.out_features, self.in_features, x2.dtype, elements, gemm)


class Int8Linear(nn.Module):
    """`nn.Linear` with an int8 weight-only copy in place of its weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_int8 = Int8Weight(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight_int8.linear(x)


def available() -> bool:
    """int8 runs on any CPU: the kernel where the C++ kernels built, dequantize + GEMM elsewhere."""
    return True


def int8_bytes(model: nn.Module) -> int:
    """Bytes of every int8 weight reachable from `model` (codes, scales, biases)."""
    seen = {id(m.weight_int8): m.weight_int8 for m in model.modules() if isinstance(m, Int8Linear)}
    seen.update({id(m.packed): m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), Int8Weight)})
    return sum(w.nbytes for w in seen.values())


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every `nn.Linear` of `model` (on CPU) whose name is not in `skip` by an
    `Int8Linear`; returns how many. A tied lm_head gets its own int8 copy; the embedding keeps
    the original."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and name not in skip and mod.weight.device.type == "cpu"]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Int8Linear(mod))
    log.info("linear layers: %d int8 weight-only (per-channel scales, %s)", len(targets),
             "C++ kernel up to %d rows" % KERNEL_MAX_ROWS if load_kernels() else "dequantized per step")
    return len(targets)
