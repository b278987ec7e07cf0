"""int8 weight-only linear layers (`EngineConfig.quantization="int8"`), applied once at load.

Each output channel n of a weight W [N, K] gets a symmetric scale s_n = max_k |W[n, k]| / 127
and int8 codes q = round(W / s_n), so the weight's bytes are halved against bf16 (a quarter
of fp32) and a decode step, bound by reading them, reads half as much. Activations stay in the
model's dtype: y = (x @ q^T) * s, computed by torch's `aten._weight_int8pack_mm` (int8 codes
widened in registers, fp32 accumulation). The error against the unquantized layer is bounded
per output by |W - q s| <= s_n / 2 elementwise: |y_n - y_q,n| <= s_n / 2 * sum_k |x_k| (plus the
activation dtype's rounding); tests/test_quantization.py checks exactly that.

`_weight_int8pack_mm` is a GEMV-style kernel, and on the Zen 4 development host it is compute-
bound, not bandwidth-bound: all of SmolLM2's linears at one row on one thread (weights out of
cache) took 33.6 ms in int8 against 35.9 ms for oneDNN's packed bf16 (best of 15, 2026-12-01,
shared host): 1.07x, about 4 G int8 MACs/s, far from halving the step. Per layer, cache-resident,
it is 1.0-1.9x at one row but already 0.9x at 2 rows, 0.3-0.5x at 8 and 0.2x at 512, and
dequantizing the codes per call costs 10-100x the GEMM. So each layer
also keeps its dequantized weight q * s in the model's dtype (oneDNN-packed in bf16, as
packed_linear.py does) for steps of more than `INT8MM_MAX_ROWS` rows: a one-row decode step
reads int8 weights, a batched step or a prefill chunk runs at the dtype's speed, and both
compute the same quantized model (to the dtype's rounding), so a sequence's tokens do not
depend on whether it decoded alone. Memory: int8 + the dtype's copy.
torch 2.13's kernel reads out of bounds (NaN, segfaults) for bf16 activations when K % 16 != 0,
so such layers always take the dtype's copy.
A C++ int8 kernel in csrc/linear.cpp's block layout (codes widened in registers, or VNNI) is what
would make int8 pay, and drop the second copy (not built).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("streamgate.engine")

INT8MM_MAX_ROWS = 1        # measured crossover on the Zen 4 host (see above)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (codes [N, K] int8, scales [N] fp32)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0      # [N]
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)              # [N, K]
    return codes.contiguous(), scales


class Int8Weight:
    """An int8 weight with its per-channel scales (one copy per activation dtype, made once)."""

    def __init__(self, weight: torch.Tensor):
        self.codes, self.scales = quantize_int8(weight)
        self.out_features, self.in_features = self.codes.shape
        self._scales = {torch.float32: self.scales, weight.dtype: self.scales.to(weight.dtype)}
        self.dtype = weight.dtype
        self.onednn = weight.dtype == torch.bfloat16 and _onednn_bf16()
        # the weight for steps of more rows (see the module docstring): [N, K] or oneDNN-packed
        wide = self.dequantized(weight.dtype)
        self.wide = torch.ops.mkldnn._reorder_linear_weight(wide, 8) if self.onednn else wide

    def scales_as(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._scales:
            self._scales[dtype] = self.scales.to(dtype)
        return self._scales[dtype]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.codes.to(torch.float32) * self.scales[:, None]).to(dtype)         # [N, K]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        x2 = x.reshape(-1, self.in_features)                                             # [M, K]
        if x2.shape[0] <= INT8MM_MAX_ROWS and (x.dtype == torch.float32 or self.in_features % 16 == 0):
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.codes, self.scales_as(x.dtype))
            if bias is not None:
                y = y + bias
        elif self.onednn and x.dtype == torch.bfloat16:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.wide, bias, "none", [], "")
        else:
            y = F.linear(x2, self.wide.to(x.dtype), bias)
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """`nn.Linear` with an int8 weight-only copy in place of its weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_int8 = Int8Weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight_int8.linear(x, self.bias)


def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every `nn.Linear` of `model` (on CPU) whose name is not in `skip` by an
    `Int8Linear`; returns how many. A tied lm_head gets its own int8 copy; the embedding keeps
    the original."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and name not in skip and mod.weight.device.type == "cpu"]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Int8Linear(mod))
    log.info("linear layers: %d int8 weight-only (per-channel scales)", len(targets))
    return len(targets)
