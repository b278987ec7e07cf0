"""gate/up and SiLU·up in one pass (linear_bf16_silu: csrc/linear_amx.h's fused epilogue on AMX
tiles, csrc/linear_dp.h's on VDPBF16PS passes): the same bits as the GEMM followed by
silu_and_mul, for row counts across the 1-3-row passes, the 8-row passes, the 16-row tiles and
the 32-row passes, with and without bias, on both paths where this CPU has AMX;
silu_and_mul(block=16) on the interleaved layout; the op's refusals; and Bf16Weight.silu_linear
on either side of its switch to the tiles."""

from __future__ import annotations

import pytest
import torch

from engine.fused_pack import fuse, fused_silu_runs
from engine.kernels import load_kernels
from tests.linear_helpers import weight

pytestmark = pytest.mark.skipif(not load_kernels() or not fused_silu_runs(),
                                reason="not the avx512_bf16 kernel build: the fused epilogue does not run")
ops = torch.ops.streamgate if load_kernels() else None
AMX = ops is not None and ops.amx_tiles()


@pytest.fixture(params=[pytest.param(False, id="vdpbf16ps"),
                        pytest.param(True, id="amx", marks=pytest.mark.skipif(not AMX, reason="no AMX tiles here"))])
def amx(request):
    """The test with AMX tiles off (VDPBF16PS passes), and again on where this CPU has them."""
    ops.amx_tiles(request.param)
    yield request.param
    ops.amx_tiles(AMX)


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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_gate_up_silu_gives_the_unfused_bits(rows, bias, amx):
    i, k = 112, 96                                      # 7 pairs of blocks: odd counts in every pass width
    lin = gate_up(i, k, bias, seed=rows)
    plain = fuse("bf16", *lin).packed                  # gate then up
    blocked = fuse("bf16", *lin, block=16).packed       # alternating blocks of 16
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2).bfloat16()
    want = ops.silu_and_mul(ops.linear_bf16(x, plain.blocks, plain.bias32, 2 * i))
    fused = ops.linear_bf16_silu(x, blocked.blocks, blocked.bias32, 2 * i)
    assert fused.shape == (rows, i) and fused.dtype == torch.bfloat16
    assert torch.equal(fused.view(torch.int16), want.view(torch.int16))
    unfused = ops.silu_and_mul(ops.linear_bf16(x, blocked.blocks, blocked.bias32, 2 * i), 16)
    assert torch.equal(unfused.view(torch.int16), want.view(torch.int16))
    assert torch.equal(blocked.silu_linear(x).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_silu_linear_below_the_tiles_gives_gate_then_up_bits(rows):
    """Up to 4 rows the VDPBF16PS passes run (row-invariant sums) with SiLU·up in their store:
    the same bits as gate then up."""
    lin = gate_up(32, 64, True, seed=7)
    plain, blocked = fuse("bf16", *lin).packed, fuse("bf16", *lin, block=16).packed
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = ops.silu_and_mul(plain.linear(x))
    assert torch.equal(blocked.silu_linear(x).view(torch.int16), want.view(torch.int16))


def test_the_fused_op_refuses_what_it_cannot_run():
    lin = gate_up(48, 64, False, seed=1)
    blocked = fuse("bf16", *lin, block=16).packed
    with pytest.raises(RuntimeError, match="bf16 rows"):
        ops.linear_bf16_silu(torch.zeros(4, 64), blocked.blocks, None, 96)
    odd = fuse("bf16", *gate_up(24, 64, False, seed=2)).packed
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_bf16_silu(torch.zeros(8, 64, dtype=torch.bfloat16), odd.blocks, None, 48)
    with pytest.raises(RuntimeError, match="block must divide"):
        ops.silu_and_mul(torch.zeros(2, 48), 16)


def test_row_invariant_one_row_gives_the_bits_it_gets_among_others():
    """A row's SiLU·up is the same whether it runs alone (a decode step) or among 7 other rows
    (speculative verification, a batch): the VDPBF16PS passes' sums do not depend on the pass."""
    ops.amx_tiles(False)
    try:
        blocked = fuse("bf16", *gate_up(64, 96, True, seed=5), block=16).packed
        x = torch.randn(8, 96, generator=torch.Generator().manual_seed(11)).bfloat16()
        together = ops.linear_bf16_silu(x, blocked.blocks, blocked.bias32, 128)
        for r in range(8):
            alone = ops.linear_bf16_silu(x[r:r + 1], blocked.blocks, blocked.bias32, 128)
            assert torch.equal(alone.view(torch.int16), together[r:r + 1].view(torch.int16))
    finally:
        ops.amx_tiles(AMX)
