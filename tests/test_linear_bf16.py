"""The bf16-weight linear kernel (csrc/linear_bf16.cpp) and its engine wrapper
(engine/packed_linear.py's Bf16Weight) against an fp64 reference computed from the same bf16
weights, with tolerances derived from fp32's (and bf16's) rounding: 1..20 rows (every register
group and the k tails), odd N and K, bias or none, fp32/bf16/fp16 and strided activations; the
engine's switch to oneDNN above BF16_KERNEL_MAX_ROWS rows (none where the CPU has no bf16 dot
products).
tests/test_kernel_variants.py runs this file in every other instruction-set variant the host
executes (AVX-512, AVX2, SSE)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import packed_linear
from engine.kernels import load_kernels, loaded_variant
from engine.packed_linear import Bf16Weight, PackedLinear
from tests.linear_helpers import assert_rows_invariant, reference_and_tolerance, weight

pytestmark = pytest.mark.skipif(not load_kernels(), reason="C++ kernels did not build")
ops = torch.ops.streamgate if load_kernels() else None


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w, b = weight(n, k, seed)
    return w.bfloat16(), b.bfloat16()


def _reference_and_tolerance(x: torch.Tensor, w: torch.Tensor, bias, out_dtype):
    """x @ w^T + b in fp64 from the bf16 weight, within gamma_{K+2} (tests/linear_helpers.py).
    The products of bf16 weights and fp32, fp16 or bf16 activations are exact in fp64, and
    in fp32 for bf16 ones (VDPBF16PS), so neither the widening nor the dot product adds to
    the bound."""
    ref, tol, _ = reference_and_tolerance(x, w, bias, out_dtype, roundings=2)
    return ref, tol


def _unpacked(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] weight a pack_bf16 result holds: [ceil(N/16), K, 16] (shift + FMA) or, in
    the avx512_bf16 variant, [ceil(N/16), ceil(K/2), 16, 2] (VDPBF16PS k-pairs)."""
    if loaded_variant() == "avx512_bf16":
        assert packed.dim() == 4 and packed.shape[1:] == (-(-k // 2), 16, 2)
        return packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * 16, -1)[:n, :k]
    assert packed.dim() == 3 and packed.shape[1:] == (k, 16)
    return packed.permute(0, 2, 1).reshape(packed.shape[0] * 16, k)[:n]


@pytest.mark.parametrize("n, k", [(37, 70), (16, 64), (1, 33), (50, 1), (200, 576), (90, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bf16_matches_the_fp64_reference(n, k, dtype, with_bias):
    """1..20 rows (the FMA tiles of up to 8 rows over up to 6 blocks and 8-row VDPBF16PS
    passes, every row tail with its k unrolling, K not a multiple of the unroll, odd K: a
    zero-padded pair), N not a multiple of 16 (a last group of fewer blocks, a last partial
    block), within the fp32-derived bound."""
    w, b = _weight(n, k, seed=n * 1000 + k)
    packed = ops.pack_bf16(w)
    assert packed.shape[0] == -(-n // 16) and packed.dtype == torch.bfloat16
    assert torch.equal(_unpacked(packed, n, k), w)
    assert torch.count_nonzero(packed) == torch.count_nonzero(w)   # zero past N and K
    bias32 = b.float() if with_bias else None
    for rows in range(1, 21):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        y = ops.linear_bf16(x, packed, bias32, n)
        assert y.dtype == dtype and y.shape == (rows, n)
        ref, tol = _reference_and_tolerance(x, w, bias32, dtype)
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), (rows, (err / tol).max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_row_rounds_as_torch_rounds_it_and_leaves_the_others(dtype):
    """A NaN in one row's activations: that row's outputs are NaN, in bf16 with the bits torch's
    own rounding gives a NaN (c10's 0x7fc0; whole blocks are rounded as vectors), an inf row's
    are not finite, and the other rows match the same rows computed without them."""
    w, _ = _weight(48, 40, seed=5)
    packed = ops.pack_bf16(w)
    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[2, 7], x[5, 0] = float("nan"), float("inf")
    y = ops.linear_bf16(x, packed, None, 48)
    assert torch.isnan(y[2]).all()
    if dtype == torch.bfloat16:          # the rounding's NaN: c10's, as torch rounds an fp32 NaN
        nan = torch.tensor(float("nan")).bfloat16().view(torch.int16)
        assert (y[2].view(torch.int16) == nan).all()
    assert not torch.isfinite(y[5]).any()
    rest = [0, 1, 3, 4, 6, 7, 8]
    assert torch.equal(y[rest], ops.linear_bf16(x[rest], packed, None, 48))


@pytest.mark.parametrize("n, k", [(37, 70), (200, 576), (40, 1), (90, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(n, k, dtype):
    """1..20 rows (every pass width and its tail, odd K): each output row is bitwise the row
    computed alone, so a decode and the same position among verified drafts agree. Where bf16
    steps of more than 4 rows run on AMX tiles (csrc/linear_amx.h) that holds up to 4
    rows, and from 5 to 20 a row's bits do not depend on how many rows share the tiles' call."""
    w, b = _weight(n, k, seed=7 * n + k)
    packed, bias32 = ops.pack_bf16(w), b.float()
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(k)).to(dtype)

    def linear(rows):
        return ops.linear_bf16(rows, packed, bias32, n)

    limit = 4 if dtype == torch.bfloat16 and k % 32 == 0 and _tiles() else 20
    assert_rows_invariant(linear, x[:limit])
    full = linear(x)
    for m in range(limit + 1, 21):
        assert torch.equal(linear(x[:m]), full[:m]), m


def _tiles() -> bool:
    return loaded_variant() == "avx512_bf16" and ops.amx_tiles()


@pytest.mark.skipif(not _tiles(), reason="no AMX tiles here (CPU, kernel variant or STREAMGATE_AMX=0)")
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_weight_on_amx_tiles_between_the_kernel_and_onednn(with_bias):
    """Bf16Weight on an AMX host: 5 to BF16_TILES_MAX_ROWS rows run the block copy on AMX tiles
    (the pair-packed blocks are AMX's B layout), more rows oneDNN; every size within the bound
    of the fp64 reference, and the tiles' rows the same bits whatever rows share the call."""
    w, b = _weight(101, 96, seed=12)
    weight = Bf16Weight(w, b if with_bias else None)
    top = packed_linear.BF16_TILES_MAX_ROWS
    x = torch.randn(top + 1, 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    bias32 = b.float() if with_bias else None
    with torch.inference_mode():
        full = weight.linear(x[:top])
        for rows in (5, 8, 17, 33, top, top + 1):
            y = weight.linear(x[:rows])
            ref, tol = _reference_and_tolerance(x[:rows], w, bias32, torch.bfloat16)
            if rows > top and with_bias:
                tol = tol + 2.0 ** -8 * (ref.abs() + tol)                # oneDNN adds the bf16 bias
            assert ((y.double() - ref).abs() <= tol).all(), rows
            if rows <= top:
                assert torch.equal(y, full[:rows]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_with_no_inputs_returns_its_bias(dtype):
    """K = 0 (an nn.Linear with in_features 0): y is the bias broadcast over the rows, on
    every path (the VDPBF16PS one once divided its block size by zero)."""
    w = torch.zeros(37, 0, dtype=torch.bfloat16)
    packed = ops.pack_bf16(w)
    bias = torch.randn(37)
    for rows in (1, 9):
        y = ops.linear_bf16(torch.zeros(rows, 0, dtype=dtype), packed, bias, 37)
        assert torch.equal(y.float(), bias.to(dtype).float().expand(rows, 37))
        assert torch.equal(ops.linear_bf16(torch.zeros(rows, 0, dtype=dtype), packed, None, 37).float(),
                           torch.zeros(rows, 37))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_bf16_takes_strided_activations_and_catches_a_wrong_weight(dtype):
    """A row-strided (odd and even stride) and a column-strided input give the contiguous
    one's result; one-hot rows read back single weights exactly (k even and odd: both halves
    of a VDPBF16PS pair, and the last k); with fp32 activations one weight changed by one bf16
    ulp shows in exactly its output column (the bound is that tight)."""
    w, _ = _weight(37, 70, seed=3)
    packed = ops.pack_bf16(w)
    base = torch.randn(5, 140).to(dtype)
    for xi in (base[:, ::2], torch.randn(5, 100).to(dtype)[:, :70], torch.randn(5, 71).to(dtype)[:, :70]):
        assert torch.equal(ops.linear_bf16(xi, packed, None, 37), ops.linear_bf16(xi.contiguous(), packed, None, 37))
    wrong = w.clone()
    wrong.view(torch.int16)[17, 5] += 1                          # one bf16 ulp
    y = ops.linear_bf16(torch.eye(70)[[4, 5, 69]].to(dtype), ops.pack_bf16(wrong), None, 37)
    assert torch.equal(y, wrong[:, [4, 5, 69]].t().to(dtype))    # one product each: exact, both halves of a pair
    if dtype == torch.float32:
        y = ops.linear_bf16(torch.ones(3, 70), ops.pack_bf16(wrong), None, 37)
        ref, tol = _reference_and_tolerance(torch.ones(3, 70), w, None, torch.float32)
        bad = ((y.double() - ref).abs() > tol).any(0)
        assert bad[17] and bad.sum() == 1


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_weight_agrees_on_both_sides_of_the_crossover(with_bias):
    """Bf16Weight: the kernel up to BF16_KERNEL_MAX_ROWS rows and oneDNN's prepacked bf16
    matmul above, or (bf16_kernel_only(): the VDPBF16PS kernel without AMX) the kernel alone,
    or (bf16_widened(): no bf16 dot products) the shift+FMA kernel alone, no oneDNN copy held in
    either; each within the bound
    of the fp64 reference ([1, M, K] as the model passes it); the bf16 GEMM may add the bf16
    bias to a rounded product: one more bf16 rounding."""
    w, b = _weight(101, 70, seed=11)
    weight = Bf16Weight(w, b if with_bias else None)
    widened = packed_linear.bf16_widened()
    assert (weight.onednn is None) == (packed_linear.bf16_kernel_only() or widened)
    limit = packed_linear.BF16_KERNEL_MAX_ROWS
    for rows in (1, limit, limit + 1, 40, 67, 130, 300):
        x = torch.randn(rows, 70, generator=torch.Generator().manual_seed(rows)).bfloat16()
        with torch.inference_mode():
            y = weight.linear(x[None])[0]
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 101)
        ref, tol = _reference_and_tolerance(x, w, b.float() if with_bias else None, torch.bfloat16)
        if rows > limit and with_bias and weight.onednn is not None:
            tol = tol + 2.0 ** -8 * (ref.abs() + tol)
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), (rows, (err / tol).max().item())


@pytest.mark.skipif(loaded_variant() == "avx512_bf16", reason="the widened GEMM reads the shift+FMA blocks' layout")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_widened_gemm_matches_the_reference_in_slices(monkeypatch, dtype):
    """MKL's fp32 GEMM on widened bf16 blocks (plain_gemm; the big steps of the avx2 build), its
    scratch slices two blocks wide: a 101-output weight in four slices, the last one 5 outputs
    past the last whole block, bias in fp32, one rounding to the rows' dtype. Bf16Weight takes it
    from BF16_WIDE_MIN_ROWS rows where bf16_wide_gemm() says so, the kernel below."""
    from engine import quantization

    monkeypatch.setattr(quantization, "SCRATCH_ELEMENTS", 70 * 16 * 2)
    monkeypatch.setattr(packed_linear, "bf16_wide_gemm", lambda: True)
    w, b = _weight(101, 70, seed=12)
    weight = Bf16Weight(w, b)
    wide = packed_linear.BF16_WIDE_MIN_ROWS
    for rows in (1, 9, wide - 1, wide, 130):
        x = torch.randn(rows, 70, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with torch.inference_mode():
            y = packed_linear.plain_gemm(x, weight.blocks, weight.bias32, 101)
            on_weight = weight.linear(x)
        assert y.dtype == dtype and y.shape == (rows, 101)
        ref, tol = _reference_and_tolerance(x, w, b.float(), dtype)
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), (rows, (err / tol).max().item())
        kernel = ops.linear_bf16(x, weight.blocks, weight.bias32, 101)
        assert torch.equal(on_weight, y if rows >= wide else kernel), rows


def test_the_kernel_alone_only_with_avx512_bf16_and_without_amx(monkeypatch):
    """oneDNN's copy is dropped only where the VDPBF16PS kernel was measured against it: the
    avx512_bf16 variant on a CPU without AMX tiles."""
    from engine import dtypes

    flags = dtypes.cpu_flags()
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda: flags | {"amx_bf16", "amx_tile"})
    assert not packed_linear.bf16_kernel_only()
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda: flags - {"amx_bf16", "amx_tile"})
    assert packed_linear.bf16_kernel_only() == (loaded_variant() == "avx512_bf16")


def test_packed_linear_runs_a_bf16_weight_through_the_block_kernel_at_few_rows():
    """A bf16 nn.Linear packed as "bf16" holds the block copy (checked against the weight),
    oneDNN's beside it unless packed_linear.bf16_kernel_only(), the bias kept in fp32 too."""
    lin = nn.Linear(70, 37, dtype=torch.bfloat16)
    packed = PackedLinear(lin, "bf16")
    assert packed.kind == "bf16" and isinstance(packed.packed, Bf16Weight)
    blocks = packed.packed.blocks
    assert torch.equal(_unpacked(blocks, 37, 70), lin.weight.detach())
    assert packed.packed.nbytes == 3 * 16 * 70 * 2 + 37 * (2 + 4)
    x = torch.randn(1, 70).bfloat16()
    with torch.inference_mode():
        ref, tol = _reference_and_tolerance(x, lin.weight.detach(), lin.bias.detach().float(), torch.bfloat16)
        assert ((packed(x).double() - ref).abs() <= tol).all()


def test_the_block_copy_is_taken_only_within_its_byte_budget(monkeypatch):
    """The fused bf16 forward asks for the block kernel's second copy only while the model's
    linear weights fit BF16_BLOCK_COPY_MAX_BYTES; over it every layer keeps oneDNN's one copy
    (where both copies are kept at all: not with the VDPBF16PS kernel without AMX)."""
    from engine import fused_llama, packed_linear

    model = nn.Sequential(nn.Linear(64, 32, dtype=torch.bfloat16), nn.Linear(32, 16, dtype=torch.bfloat16))
    extra = (64 * 32 + 32 * 16) * 2
    monkeypatch.setattr(fused_llama, "BF16_BLOCK_COPY_MAX_BYTES", extra)
    assert fused_llama.bf16_block_copy_fits(model)
    monkeypatch.setattr(fused_llama, "BF16_BLOCK_COPY_MAX_BYTES", extra - 1)
    assert not fused_llama.bf16_block_copy_fits(model)
    assert packed_linear.BF16_BLOCK_COPY_MAX_BYTES >= 1 << 30        # SmolLM2's 269 MB fits
