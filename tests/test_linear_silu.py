"""gate/up and SiLU·up in one AMX pass (csrc/linear_amx.h's fused epilogue, linear_bf16_silu):
the same bits as the GEMM followed by silu_and_mul, for row counts across the 16-row tiles and
the 32-row passes, with and without bias; silu_and_mul(block=16) on the interleaved layout;
the op's refusals; and Bf16Weight.silu_linear on either side of its switch to the tiles."""

from __future__ import annotations

import pytest
import torch

from engine.fused_llama import _fuse, fused_silu_runs
from engine.kernels import load_kernels
from tests.linear_helpers import weight

pytestmark = pytest.mark.skipif(not load_kernels() or not fused_silu_runs(),
                                reason="no AMX tiles in this kernel build or CPU: the fused epilogue does not run")
ops = torch.ops.streamgate if load_kernels() else None


def gate_up(i: int, k: int, bias: bool, seed: int):
    g, bg = weight(i, k, seed)
    u, bu = weight(i, k, seed + 1)
    lin = [torch.nn.Linear(k, i, bias=bias, dtype=torch.bfloat16) for _ in range(2)]
    with torch.no_grad():
        for m, w, b in ((lin[0], g, bg), (lin[1], u, bu)):
            m.weight.copy_(w.bfloat16())
            if bias:
                m.bias.copy_(b.bfloat16())
    return lin


@pytest.mark.parametrize("rows", [5, 16, 17, 32, 33, 64, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_gate_up_silu_gives_the_unfused_bits(rows, bias):
    i, k = 112, 96                                      # 14 blocks: 16-row steps take them four at a time
    lin = gate_up(i, k, bias, seed=rows)
    plain = _fuse("bf16", *lin).packed                  # gate then up
    blocked = _fuse("bf16", *lin, block=16).packed       # alternating blocks of 16
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2).bfloat16()
    want = ops.silu_and_mul(ops.linear_bf16(x, plain.blocks, plain.bias32, 2 * i))
    fused = ops.linear_bf16_silu(x, blocked.blocks, blocked.bias32, 2 * i)
    assert fused.shape == (rows, i) and fused.dtype == torch.bfloat16
    assert torch.equal(fused.view(torch.int16), want.view(torch.int16))
    unfused = ops.silu_and_mul(ops.linear_bf16(x, blocked.blocks, blocked.bias32, 2 * i), 16)
    assert torch.equal(unfused.view(torch.int16), want.view(torch.int16))
    assert torch.equal(blocked.silu_linear(x).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_silu_linear_below_the_tiles_takes_the_block_kernel_then_silu(rows):
    """Up to 4 rows the block kernel runs (row-invariant sums), then silu_and_mul(block=16):
    the same bits as gate then up."""
    lin = gate_up(32, 64, True, seed=7)
    plain, blocked = _fuse("bf16", *lin).packed, _fuse("bf16", *lin, block=16).packed
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = ops.silu_and_mul(plain.linear(x))
    assert torch.equal(blocked.silu_linear(x).view(torch.int16), want.view(torch.int16))


def test_the_fused_op_refuses_what_it_cannot_run():
    lin = gate_up(48, 64, False, seed=1)
    blocked = _fuse("bf16", *lin, block=16).packed
    with pytest.raises(RuntimeError, match="AMX tiles only"):
        ops.linear_bf16_silu(torch.zeros(4, 64, dtype=torch.bfloat16), blocked.blocks, None, 96)
    odd = _fuse("bf16", *gate_up(24, 64, False, seed=2)).packed
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_bf16_silu(torch.zeros(8, 64, dtype=torch.bfloat16), odd.blocks, None, 48)
    with pytest.raises(RuntimeError, match="block must divide"):
        ops.silu_and_mul(torch.zeros(2, 48), 16)
