"""oneDNN prepacked linear layers (engine/packed_linear.py): same products as nn.Linear, used
by default for eager fp32 on CPU, and off when asked."""

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.packed_linear import PackedLinear, available

pytestmark = pytest.mark.skipif(not available(), reason="torch built without oneDNN (mkldnn)")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear_for_any_row_count(bias):
    """Packed for 8 rows, it still gives nn.Linear's product (to fp32 rounding) for 1, 8, 33
    rows and for a [1, N, in] batch as the model passes it."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(lin, rows_hint=8)
    for shape in [(1, 96), (8, 96), (33, 96), (1, 17, 96)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            ref, out = lin(x), packed(x)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_runner_packs_eager_fp32_by_default_and_not_when_off(tiny_model):
    """Every nn.Linear of the model (lm_head included) is packed by default; packed_linear=False
    keeps plain nn.Linear; the embedding a tied lm_head shares is left as it was."""
    model = tiny_model("llama")
    on = ModelRunner(EngineConfig(model=model, num_kv_blocks=64)).model
    off = ModelRunner(EngineConfig(model=model, num_kv_blocks=64, packed_linear=False)).model
    assert not any(type(m) is nn.Linear for m in on.modules())
    assert sum(isinstance(m, PackedLinear) for m in on.modules()) == sum(type(m) is nn.Linear for m in off.modules()) > 0
    assert isinstance(on.get_input_embeddings(), nn.Embedding)


def test_packed_linear_option_is_validated():
    """A non-bool packed_linear names the field."""
    with pytest.raises(ValueError, match="packed_linear"):
        EngineConfig(packed_linear="yes")
