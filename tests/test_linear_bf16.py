"""The bf16-weight linear kernel (csrc/linear_bf16.cpp) and its engine wrapper
(engine/packed_linear.py's Bf16Weight) against an fp64 reference computed from the same bf16
weights, with tolerances derived from fp32's (and bf16's) rounding: 1..20 rows (every register
group and the k tails), odd N and K, bias or none, fp32/bf16/fp16 and strided activations; the
engine's switch to oneDNN above BF16_KERNEL_MAX_ROWS rows.
tests/test_kernel_variants.py runs this file in every other instruction-set variant the host
executes (AVX-512, AVX2, SSE)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import packed_linear
from engine.kernels import load_kernels
from engine.packed_linear import Bf16Weight, PackedLinear

pytestmark = pytest.mark.skipif(not load_kernels(), reason="C++ kernels did not build")
U = 2.0 ** -24                   # fp32 unit roundoff
ops = torch.ops.streamgate if load_kernels() else None


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]      # outputs of different ranges
    return w.bfloat16(), torch.randn(n, generator=g).bfloat16()


def _reference_and_tolerance(x: torch.Tensor, w: torch.Tensor, bias, out_dtype):
    """x @ w^T + b in fp64 from the bf16 weight (exact in fp32, so the kernel's widening adds
    nothing), and the largest error an fp32-accumulating kernel may make: K products summed
    in any order plus the bias (gamma_{K+2} relative to sum |x||w| + |b|); a bf16 or fp16
    output adds the rounding of the result (2^-8 or 2^-11 relative; fp16's subnormals, below
    2^-14, are rounded to a multiple of 2^-24: half of that absolute)."""
    xd, w = x.double(), w.double()
    ref = xd @ w.T + (0 if bias is None else bias.double())
    mag = xd.abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    k = x.shape[1]
    tol = (k + 2) * U / (1 - (k + 2) * U) * mag
    out_u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(out_dtype)
    if out_u:
        tol = tol + out_u * (ref.abs() + tol) + (2.0 ** -25 if out_dtype == torch.float16 else 0.0)
    return ref, tol


@pytest.mark.parametrize("n, k", [(37, 70), (16, 64), (1, 33), (50, 1), (200, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bf16_matches_the_fp64_reference(n, k, dtype, with_bias):
    """1..20 rows (4-row passes, the 3/2/1-row tails with their k unrolling, K not a multiple
    of the unroll), N not a multiple of 16, within the fp32-derived bound."""
    w, b = _weight(n, k, seed=n * 1000 + k)
    packed = ops.pack_bf16(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.dtype == torch.bfloat16
    bias32 = b.float() if with_bias else None
    for rows in range(1, 21):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        y = ops.linear_bf16(x, packed, bias32, n)
        assert y.dtype == dtype and y.shape == (rows, n)
        ref, tol = _reference_and_tolerance(x, w, bias32, dtype)
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), (rows, (err / tol).max().item())


def test_linear_bf16_takes_strided_activations_and_catches_a_wrong_weight():
    """A row-strided and a column-strided input give the contiguous one's result; one weight
    changed by one bf16 ulp shows in exactly its output column (the bound is that tight)."""
    w, _ = _weight(37, 70, seed=3)
    base = torch.randn(5, 140)
    x = base[:, ::2]                                             # stride 2 along K
    rows = torch.randn(5, 100)[:, :70]                           # row stride 100
    for xi in (x, rows):
        assert torch.equal(ops.linear_bf16(xi, ops.pack_bf16(w), None, 37),
                           ops.linear_bf16(xi.contiguous(), ops.pack_bf16(w), None, 37))
    x = torch.ones(3, 70)
    wrong = w.clone()
    wrong.view(torch.int16)[17, 5] += 1                          # one bf16 ulp
    y = ops.linear_bf16(x, ops.pack_bf16(wrong), None, 37)
    ref, tol = _reference_and_tolerance(x, w, None, torch.float32)
    bad = ((y.double() - ref).abs() > tol).any(0)
    assert bad[17] and bad.sum() == 1


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_weight_agrees_on_both_sides_of_the_crossover(with_bias):
    """Bf16Weight: the kernel up to BF16_KERNEL_MAX_ROWS rows, oneDNN's prepacked bf16 matmul
    above, each within the bound of the fp64 reference ([1, M, K] as the model passes it); the
    bf16 GEMM may add the bf16 bias to a rounded product: one more bf16 rounding."""
    w, b = _weight(101, 70, seed=11)
    weight = Bf16Weight(w, b if with_bias else None)
    limit = packed_linear.BF16_KERNEL_MAX_ROWS
    for rows in (1, limit, limit + 1, 40):
        x = torch.randn(rows, 70, generator=torch.Generator().manual_seed(rows)).bfloat16()
        with torch.inference_mode():
            y = weight.linear(x[None])[0]
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 101)
        ref, tol = _reference_and_tolerance(x, w, b.float() if with_bias else None, torch.bfloat16)
        if rows > limit and with_bias:
            tol = tol + 2.0 ** -8 * (ref.abs() + tol)
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), (rows, (err / tol).max().item())


def test_packed_linear_runs_a_bf16_weight_through_the_block_kernel_at_few_rows():
    """A bf16 nn.Linear packed as "bf16" holds the block copy (checked against the weight),
    oneDNN's beside it, the bias kept in fp32 too."""
    lin = nn.Linear(70, 37, dtype=torch.bfloat16)
    packed = PackedLinear(lin, "bf16")
    assert packed.kind == "bf16" and isinstance(packed.packed, Bf16Weight)
    blocks = packed.packed.blocks
    assert blocks.shape == (3, 70, 16)
    assert torch.equal(blocks.permute(0, 2, 1).reshape(48, 70)[:37], lin.weight.detach())
    assert packed.packed.nbytes == 3 * 16 * 70 * 2 + 37 * (2 + 4)
    x = torch.randn(1, 70).bfloat16()
    with torch.inference_mode():
        ref, tol = _reference_and_tolerance(x, lin.weight.detach(), lin.bias.detach().float(), torch.bfloat16)
        assert ((packed(x).double() - ref).abs() <= tol).all()


def test_the_block_copy_is_taken_only_within_its_byte_budget(monkeypatch):
    """The fused bf16 forward asks for the block kernel's second copy only while the model's
    linear weights fit BF16_BLOCK_COPY_MAX_BYTES; over it every layer keeps oneDNN's one copy."""
    from engine import fused_llama, packed_linear

    model = nn.Sequential(nn.Linear(64, 32, dtype=torch.bfloat16), nn.Linear(32, 16, dtype=torch.bfloat16))
    extra = (64 * 32 + 32 * 16) * 2
    monkeypatch.setattr(fused_llama, "BF16_BLOCK_COPY_MAX_BYTES", extra)
    assert fused_llama.bf16_block_copy_fits(model)
    monkeypatch.setattr(fused_llama, "BF16_BLOCK_COPY_MAX_BYTES", extra - 1)
    assert not fused_llama.bf16_block_copy_fits(model)
    assert packed_linear.BF16_BLOCK_COPY_MAX_BYTES >= 1 << 30        # SmolLM2's 269 MB fits
