"""Packed linear layers (engine/packed_linear.py: the C++ kernel of csrc/linear.cpp, and oneDNN
where it did not build): same products as nn.Linear, used by default for eager fp32 on CPU,
and off when asked."""

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.kernels import load_kernels
from engine import packed_linear, quantization
from engine.packed_linear import PackedLinear, available
from tests.linear_helpers import assert_rows_invariant

pytestmark = pytest.mark.skipif(not available(), reason="neither the C++ kernels nor oneDNN are available")
KINDS = [pytest.param("streamgate", marks=pytest.mark.skipif(not load_kernels(), reason="C++ kernels did not build")),
         pytest.param("onednn", marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN"))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [160, 37])
def test_packed_linear_matches_nn_linear_for_any_row_count(kind, bias, out_features):
    """Either packed form gives nn.Linear's product (to fp32 rounding) for 1 to 4 rows (every
    register group of the kernel), 8, 33 and a [1, N, in] batch as the model passes it, a
    non-contiguous input, and an output size that is not a whole number of 16-wide blocks."""
    torch.manual_seed(0)
    lin = nn.Linear(96, out_features, bias=bias)
    packed = PackedLinear(lin, kind)
    strided = torch.randn(96, 5).t()                              # [5, 96], stride 1 over rows
    for x in [torch.randn(*shape) for shape in [(1, 96), (2, 96), (3, 96), (4, 96), (8, 96), (33, 96), (1, 17, 96)]] + [strided]:
        with torch.inference_mode():
            ref, out = lin(x), packed(x)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not load_kernels(), reason="C++ kernels did not build")
def test_the_fp32_kernel_gives_a_row_the_same_bits_whatever_rows_share_its_call():
    """Each output row of the fp32 kernel is bitwise the row computed alone (one fp32 chain
    per (row, output) over k in order, whatever the tile), so a decode and the same position
    among verified drafts agree: 1..20 rows, every tile and row tail."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(96, 37), "streamgate")
    with torch.inference_mode():
        assert_rows_invariant(packed, torch.randn(20, 96))


@pytest.mark.skipif(not load_kernels(), reason="C++ kernels did not build")
@pytest.mark.parametrize("bias", [False, True])
def test_plain_gemm_on_fp32_blocks_transposed_and_the_kernel_at_many_rows(monkeypatch, bias):
    """plain_gemm (the avx2 build's big bf16 steps, on fp32 blocks here, tested on every host): the
    blocks transposed into the scratch buffer, here two blocks (32 outputs) at a time, so 37
    outputs take two slices, the last one 5 wide; and the kernel (every fp32 step): nn.Linear's
    product to fp32 rounding."""
    monkeypatch.setattr(quantization, "SCRATCH_ELEMENTS", 96 * 16 * 2)
    torch.manual_seed(2)
    lin = nn.Linear(96, 37, bias=bias)
    packed = PackedLinear(lin, "streamgate")
    x = torch.randn(131, 96)
    with torch.inference_mode():
        got = packed_linear.plain_gemm(x, packed.packed, packed.bias, 37)
        torch.testing.assert_close(got, lin(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-4, atol=1e-4)      # the kernel
    assert got.shape == (131, 37)


def test_runner_packs_eager_fp32_by_default_and_not_when_off(tiny_model):
    """Every nn.Linear of the model (lm_head included) is packed by default; packed_linear=False
    keeps plain nn.Linear; the embedding a tied lm_head shares is left as it was."""
    model = tiny_model("llama")
    on = ModelRunner(EngineConfig(model=model, num_kv_blocks=64, fused_layers=False)).model
    off = ModelRunner(EngineConfig(model=model, num_kv_blocks=64, packed_linear=False)).model
    assert not any(type(m) is nn.Linear for m in on.modules())
    assert sum(isinstance(m, PackedLinear) for m in on.modules()) == sum(type(m) is nn.Linear for m in off.modules()) > 0
    assert isinstance(on.get_input_embeddings(), nn.Embedding)
    assert {m.kind for m in on.modules() if isinstance(m, PackedLinear)} == {available()}


def test_packed_linear_option_is_validated():
    """A non-bool packed_linear names the field."""
    with pytest.raises(ValueError, match="packed_linear"):
        EngineConfig(packed_linear="yes")
