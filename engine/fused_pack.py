"""How the fused forward (fused_llama.py) packs a decoder layer's linears: q/k/v as one packed
GEMM and gate/up as another (vLLM's QKV and merged gate-up layers), gate/up alternating in blocks
of 16 where the kernel applies SiLU·up in its epilogue; and what each packed linear's forward
comes down to (its weight object, its packed blocks) for the one-call layer loop."""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from .packed_linear import PackedLinear
from .quantization import Int8Weight


def fuse(kind: str, *linears: nn.Linear, block: int = 0) -> PackedLinear:
    """One packed linear computing the concatenation of `linears`' outputs (block > 0, two
    linears: their outputs alternating in blocks of `block`, as silu_and_mul(block) reads them)."""
    w = linears[0].weight

    def joined(ts):
        if not block:
            return torch.cat(ts)
        return torch.stack([t.reshape(-1, block, *t.shape[1:]) for t in ts], 1).reshape(-1, *ts[0].shape[1:])

    fused = nn.Linear(w.shape[1], sum(m.out_features for m in linears), bias=linears[0].bias is not None, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(joined([m.weight for m in linears]))
        if fused.bias is not None:
            fused.bias.copy_(joined([m.bias for m in linears]))
    return PackedLinear(fused, kind)


def silu_block(kind: str, mlp: nn.Module) -> int:
    """16 where gate/up can run as one pass with SiLU·up in its epilogue (bf16 block weights,
    whole 16-output blocks, a kernel build that runs it: AMX tiles or VDPBF16PS passes,
    csrc/linear_amx.h and linear_dp.h), so they are packed alternating in blocks of 16; else 0
    (gate then up)."""
    return 16 if (kind == "bf16" and mlp.gate_proj.weight.dtype == torch.bfloat16 and mlp.gate_proj.out_features % 16 == 0
                  and fused_silu_runs()) else 0


@cache
def fused_silu_runs() -> bool:
    """Whether this process's kernels run linear_bf16_silu (the avx512_bf16 build): tried once
    on a 5 x 32 step."""
    try:
        w = torch.ops.streamgate.pack_bf16(torch.zeros(32, 32, dtype=torch.bfloat16))
        torch.ops.streamgate.linear_bf16_silu(torch.zeros(5, 32, dtype=torch.bfloat16), w, None, 32)
        return True
    except RuntimeError:
        return False


def packed_of(weight) -> torch.Tensor:
    """A bf16 or int8 weight's packed blocks (what its kernel reads)."""
    return weight.codes if isinstance(weight, Int8Weight) else weight.blocks


def weight_of(linear: PackedLinear):
    """What a packed linear's forward comes down to, as an object with `.linear(x)`: its int8
    or bf16 weight, else the module itself (called so, without nn.Module's call machinery)."""
    return linear.packed if linear.kind in ("int8", "bf16") else linear
