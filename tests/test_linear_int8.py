"""The int8 weight-only kernels (csrc/linear_int8.cpp) against an fp32 reference computed from the
dequantized weights, with tolerances derived from fp32's (and bf16's) rounding: the kernel for
1..20 rows (every register group and the k tails), odd N and K, bias or none, fp32 and bf16
activations; dequantize_int8 bit-exact against torch's rounding; the many-row path through the
scratch buffer, split or whole. tests/test_kernel_variants.py runs this file in every other
instruction-set variant the host executes (AVX-512, AVX2, SSE)."""

from __future__ import annotations

import pytest
import torch

from engine import quantization
from engine.dtypes import native_bf16_cpu
from engine.kernels import load_kernels, loaded_variant
from engine.quantization import Int8Weight, quantize_int8
from tests.linear_helpers import U, assert_rows_invariant, reference_and_tolerance, weight

pytestmark = pytest.mark.skipif(not load_kernels(), reason="C++ kernels did not build")
ops = torch.ops.streamgate if load_kernels() else None
_weight = weight


VNNI_MAX_ROWS = 12          # csrc/linear_int8.cpp's kVnniMaxRows


def _on_vnni(x) -> bool:
    """Whether linear_int8 runs these rows on VNNI (csrc/linear_vnni.h): bf16/fp16 rows, K % 4
    == 0, VNNI built and on, and not past kVnniMaxRows where AMX tiles take bf16 steps."""
    k, rows = x.shape[1], x.shape[0]
    amx = x.dtype == torch.bfloat16 and k % 32 == 0 and ops.amx_tiles() and rows > VNNI_MAX_ROWS
    return x.dtype != torch.float32 and k % 4 == 0 and ops.int8_vnni() and not amx


def _reference_and_tolerance(x, w, bias, out_dtype):
    """The fp64 reference from the dequantized weight w, within gamma_{K+4}: the K products,
    then the scale, the bias and the dequantized weight's own fp32 rounding. On VNNI each row
    is first rounded to int16 steps of max|x| / 32767: at most half a step (and the 2^-24 of
    the multiply that finds it) per element, times sum |w| per output."""
    ref, tol, mag = reference_and_tolerance(x, w, bias, out_dtype, roundings=4)
    if _on_vnni(x):
        step = x.double().abs().amax(-1, keepdim=True) / 32767
        tol = tol + 0.51 * step * w.double().abs().sum(-1)[None, :]
    return ref, tol, mag


def _dequantized(codes, scales):
    return codes.float() * scales[:, None]


def _widened(x) -> bool:
    """Whether Int8Weight.linear runs these many rows as an fp32 GEMM (bf16 rows on a CPU
    without bf16 dot products, not on the block kernel): the weight dequantized in fp32."""
    return x.dtype == torch.bfloat16 and not native_bf16_cpu() and not _on_blocks(x)


def _on_blocks(x) -> bool:
    """Whether Int8Weight.linear runs these many rows on the bf16 block kernel (the avx512_bf16
    build, bf16 rows not on AMX tiles), dequantized into its layout."""
    amx = x.dtype == torch.bfloat16 and x.shape[1] % 32 == 0 and ops.amx_tiles()
    return x.dtype == torch.bfloat16 and loaded_variant() == "avx512_bf16" and not amx


@pytest.mark.parametrize("n, k", [(37, 70), (16, 64), (50, 33), (3, 1), (200, 576)])
def test_dequantize_int8_bf16_writes_what_pack_bf16_packs(n, k):
    """The codes dequantized straight into the block kernel's layout are pack_bf16 of q * s
    rounded to bf16, bit for bit: odd K (the last pair's zero half), N past a block (zero
    outputs), whatever the buffer held before."""
    w, _ = _weight(n, k, seed=n + 7 * k)
    codes, scales = quantize_int8(w)
    want = ops.pack_bf16(_dequantized(codes, scales).to(torch.bfloat16))
    out = torch.full_like(want, float("nan"))
    ops.dequantize_int8_bf16(ops.pack_int8(codes), scales, out)
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match="scales"):
        ops.dequantize_int8_bf16(ops.pack_int8(codes), torch.ones(n + 16), out)     # a block more than the codes


@pytest.mark.skipif(load_kernels() and loaded_variant() != "avx512_bf16", reason="the block kernel's bf16 layout only")
@pytest.mark.parametrize("scratch_elements", [1 << 22, 16 * 70])      # whole, and 16 outputs at a time
def test_many_bf16_rows_run_the_block_kernel_on_the_dequantized_weight(monkeypatch, scratch_elements):
    """Past KERNEL_MAX_ROWS, bf16 rows in the avx512_bf16 build give exactly linear_bf16 on
    pack_bf16 of the bf16-rounded dequantized weight (in slices of the scratch buffer or whole)."""
    monkeypatch.setattr(quantization, "SCRATCH_ELEMENTS", scratch_elements)
    w, b = _weight(37, 70, seed=19)
    weight = Int8Weight(w.to(torch.bfloat16), b.to(torch.bfloat16))
    codes, scales = quantize_int8(w.to(torch.bfloat16))
    x = torch.randn(quantization.KERNEL_MAX_ROWS + 40, 70).to(torch.bfloat16)
    packed = ops.pack_bf16(_dequantized(codes, scales).to(torch.bfloat16))
    want = ops.linear_bf16(x, packed, b.to(torch.bfloat16).float(), 37)
    assert torch.equal(weight.linear(x), want)


@pytest.mark.parametrize("n, k", [(37, 70), (16, 64), (1, 33), (50, 1), (200, 576), (90, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_int8_matches_the_dequantized_fp32_reference(n, k, dtype, with_bias):
    """1..20 rows (every row group: the FMA tiles of up to 8 rows over up to 6 blocks and their
    row tails, VNNI's passes where they run), N not a multiple of 16, within the fp32-derived
    bound."""
    w, b = _weight(n, k, seed=n * 1000 + k)
    codes, scales = quantize_int8(w)
    packed = ops.pack_int8(codes)
    assert packed.shape == (-(-n // 16), k, 16) and packed.dtype == torch.int8
    bias32 = b if with_bias else None
    for rows in range(1, 21):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        y = ops.linear_int8(x, packed, scales, bias32, n)
        assert y.dtype == dtype and y.shape == (rows, n)
        ref, tol, _ = _reference_and_tolerance(x, _dequantized(codes, scales), bias32, dtype)
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), (rows, (err / tol).max().item())


@pytest.mark.parametrize("n, k", [(37, 70), (200, 576), (40, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(n, k, dtype):
    """1..20 rows (every pass width and its tail): each output row is bitwise the row computed
    alone, so a decode and the same position among verified drafts agree. Where bf16 steps of
    more than 8 rows (12 where bf16 rows take VNNI) run on AMX tiles (csrc/linear_amx.h) that
    holds up to there, and past it a row's bits do not depend on how many rows share the
    tiles' call."""
    w, b = _weight(n, k, seed=7 * n + k)
    codes, scales = quantize_int8(w)
    packed = ops.pack_int8(codes)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(k)).to(dtype)

    def linear(rows):
        return ops.linear_int8(rows, packed, scales, b, n)

    vnni = dtype != torch.float32 and k % 4 == 0 and ops.int8_vnni()     # VNNI's rows (csrc/linear_vnni.h)
    limit = (12 if vnni else 8) if dtype == torch.bfloat16 and k % 32 == 0 and ops.amx_tiles() else 20
    assert_rows_invariant(linear, x[:limit])
    full = linear(x)
    for m in range(limit + 1, 21):
        assert torch.equal(linear(x[:m]), full[:m]), m


def test_linear_int8_catches_a_wrong_scale():
    """The tolerance is tight enough to see one output channel's scale off by one part in 10^3."""
    w, _ = _weight(37, 70, seed=3)
    codes, scales = quantize_int8(w)
    x = torch.randn(3, 70)
    wrong = scales.clone()
    wrong[17] *= 1 + 1e-3
    y = ops.linear_int8(x, ops.pack_int8(codes), wrong, None, 37)
    ref, tol, _ = _reference_and_tolerance(x, _dequantized(codes, scales), None, torch.float32)
    bad = ((y.double() - ref).abs() > tol).any(0)
    assert bad[17] and bad.sum() == 1


def test_linear_int8_takes_strided_and_fp16_activations():
    """A non-contiguous x (stride 1 over rows) and fp16 activations are converted, not misread."""
    w, b = _weight(40, 48, seed=5)
    codes, scales = quantize_int8(w)
    packed = ops.pack_int8(codes)
    x = torch.randn(48, 5).t()                                        # [5, 48], stride (1, 5)
    ref, tol, _ = _reference_and_tolerance(x, _dequantized(codes, scales), b, torch.float32)
    assert ((ops.linear_int8(x, packed, scales, b, 40).double() - ref).abs() <= tol).all()
    xh = x.half()
    ref, tol, _ = _reference_and_tolerance(xh, _dequantized(codes, scales), b, torch.bfloat16)    # fp16: finer than bf16
    assert ((ops.linear_int8(xh, packed, scales, b, 40).double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_int8_rounds_exactly_as_torch(dtype):
    """q * s computed in fp32 and rounded once to the dtype, bit for bit, written transposed
    ([K, N]), whole or by output slices of whole blocks (the last one partial)."""
    w, _ = _weight(53, 37, seed=7)
    codes, scales = quantize_int8(w)
    want = (codes.float() * scales[:, None]).to(dtype)
    weight = Int8Weight(w)
    assert torch.equal(weight.dequantized(dtype), want.t())                    # [K, N]: transposed
    assert torch.equal(weight.dequantized(dtype, (16, 48)), want[16:48].t())
    assert torch.equal(weight.dequantized(dtype, (32, 53)), want[32:53].t())


@pytest.mark.parametrize("scratch_elements", [1 << 22, 16 * 70])      # whole, and 16 outputs at a time
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_dequantize_into_the_scratch_buffer(monkeypatch, scratch_elements, dtype):
    """Above KERNEL_MAX_ROWS the layer dequantizes (into one reused buffer, in slices when the
    weight is larger than it) and runs the dtype's GEMM: the product of the dequantized
    weight, to the dtype's rounding; the kernel and this path agree at the crossover."""
    monkeypatch.setattr(quantization, "SCRATCH_ELEMENTS", scratch_elements)
    quantization._scratch.__dict__.clear()                      # this thread's buffers, grown by other tests
    w, b = _weight(37, 70, seed=11)
    w, b = w.to(dtype), b.to(dtype)
    weight = Int8Weight(w, b)
    codes, scales = quantize_int8(w)
    rows = quantization.KERNEL_MAX_ROWS + 9
    x = torch.randn(rows, 70).to(dtype)
    y = weight.linear(x)
    assert y.dtype == dtype and y.shape == (rows, 37)
    gemm_dtype = torch.float32 if _widened(x) else dtype                 # the GEMM's weight and scratch
    ref, tol, mag = _reference_and_tolerance(x, _dequantized(codes, scales).to(gemm_dtype), b, dtype)
    assert ((y.double() - ref).abs() <= tol).all()
    buf = quantization.scratch(gemm_dtype, 1)
    outputs = min(37, max(16, scratch_elements // 70 // 16 * 16))
    held = -(-outputs // 16) * 16 * 70 if _on_blocks(x) else outputs * 70        # whole blocks of k-pairs
    assert buf.untyped_storage().nbytes() == held * buf.element_size()
    m = quantization.KERNEL_MAX_ROWS
    few = weight.linear(x[:m])                                  # the kernel, on the same rows
    ref_k, tol_k, _ = _reference_and_tolerance(x[:m], _dequantized(codes, scales), b, dtype)
    assert ((few.double() - ref_k).abs() <= tol_k).all()
    weight_rounding = (2.0 ** -9 if gemm_dtype == torch.bfloat16 else U) * mag[:m]     # q s in the dtype or not
    assert ((few.double() - y[:m].double()).abs() <= tol_k + tol[:m] + weight_rounding).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_kernels_every_step_dequantizes_the_unpacked_codes(dtype):
    """Where the C++ kernels did not build, the codes stay [N, K] and torch dequantizes them
    (into fp32 for bf16 rows on a CPU without bf16 dot products): the same product as the
    kernel's path, one row or many."""
    w, b = _weight(37, 70, seed=13)
    w, b = w.to(dtype), b.to(dtype)
    fast, slow = Int8Weight(w, b), Int8Weight(w, b)
    codes, scales = quantize_int8(w)
    slow.kernel, slow.codes = False, codes                       # as built without the kernels
    assert torch.equal(slow.dequantized(dtype), fast.dequantized(dtype))
    for rows in (1, quantization.KERNEL_MAX_ROWS + 3):
        x = torch.randn(rows, 70).to(dtype)
        gemm_dtype = torch.float32 if dtype == torch.bfloat16 and not native_bf16_cpu() else dtype
        ref, tol, mag = _reference_and_tolerance(x, _dequantized(codes, scales).to(gemm_dtype), b, dtype)
        assert ((slow.linear(x).double() - ref).abs() <= tol).all()


def test_the_scratch_buffer_made_in_inference_mode_is_writable_outside_it():
    """The engine's steps run under inference_mode; a later call in the same thread outside it
    (a test, no_grad) must still write the thread's scratch buffer in place. A fresh thread, so
    the buffer is made here, under inference_mode, whatever ran before."""
    import threading

    w, b = _weight(37, 70, seed=17)
    slow = Int8Weight(w, b)
    codes, _ = quantize_int8(w)
    slow.kernel, slow.codes = False, codes                       # torch's dequantization path
    x = torch.randn(quantization.KERNEL_MAX_ROWS + 3, 70)
    out, errors = {}, []

    def work():
        try:
            with torch.inference_mode():
                out["inference"] = slow.linear(x)
            with torch.no_grad():
                out["no_grad"] = slow.linear(x)
        except Exception as e:               # reported to the test's thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    assert torch.equal(out["inference"], out["no_grad"])
