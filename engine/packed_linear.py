"""oneDNN linear layers with prepacked weights, for eager fp32 on CPU.

torch's `F.linear` on CPU calls MKL's sgemm, which leaves the second core idle on the
few-row GEMMs of a decode step: a [8, 576] x [576, 1536] product takes 512 us on two
threads and 557 us on one. oneDNN's matmul with the weight reordered once into its
blocked layout (what inductor's weight prepacking and vLLM's CPU linear use) takes 239 us
on two threads, 2.1x; 1.3x at 32 rows, 1.15x at 256, even at one row
(docs/BENCHMARKS.md §8.12). Results differ from MKL's in the last bits (another
summation order), as between any two GEMM libraries.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("streamgate.engine")


class PackedLinear(nn.Module):
    """`nn.Linear` whose weight is kept only in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, rows_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_linears(model: nn.Module, rows_hint: int = 8) -> int:
    """Replace every fp32 `nn.Linear` of `model` (on CPU) by a `PackedLinear`; returns how
    many. A tied lm_head gets its own packed copy; the embedding keeps the original."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and mod.weight.dtype == torch.float32 and mod.weight.device.type == "cpu"]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, PackedLinear(mod, rows_hint))
    log.info("linear layers: %d prepacked for oneDNN", len(targets))
    return len(targets)


def maybe_pack(model: nn.Module, config, device: torch.device, dtype: torch.dtype) -> bool:
    """Pack for eager fp32 on CPU in one process, unless `config.packed_linear` is False
    (a compiled model is left to inductor; tensor-parallel shards are DTensors)."""
    if config.packed_linear is False or config.compile or config.tensor_parallel_size > 1:
        return False
    if not (device.type == "cpu" and dtype == torch.float32 and available()):
        return False
    return pack_linears(model) > 0
