"""int8 weight-only linears (engine/quantization.py): the layer against the fp32 layer within the
quantization error bound, the engine generating with them (fused and transformers' forward), and
the config field's validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.quantization import KERNEL_MAX_ROWS, Int8Linear, Int8Weight, available, int8_bytes, quantize_int8

pytestmark = pytest.mark.skipif(not available(), reason="int8 is not available")


def _linear(n: int = 37, k: int = 70, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.mul_(torch.logspace(-2, 1, n)[:, None])          # channels of very different ranges
    return lin


def _bound(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """|y - y_q| <= s_n / 2 * sum_k |x_k| per row and output (|W - q s| <= s / 2 elementwise)."""
    _, scales = quantize_int8(lin.weight)
    return scales[None, :].double() / 2 * x.double().abs().sum(-1, keepdim=True)       # [M, N]


@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 4])      # the kernel and the dequantized GEMM
def test_int8_linear_within_the_quantization_bound_of_the_fp32_linear(rows):
    """Int8Linear(x) is within s/2 * sum|x| (+ fp32 rounding) of the fp32 linear, per output,
    and equals x @ (q s)^T + b to fp32 rounding."""
    lin = _linear()
    x = torch.randn(rows, 70)
    q = Int8Linear(lin)
    with torch.inference_mode():
        y = q(x)
    ref = x.double() @ lin.weight.double().T + lin.bias.double()
    mag = x.double().abs() @ lin.weight.double().abs().T + lin.bias.double().abs()      # [M, N]
    fp32_slack = 4 * torch.finfo(torch.float32).eps * 70 * mag
    err = (y.double() - ref).abs()
    assert (err <= _bound(lin, x) + fp32_slack).all(), (err / _bound(lin, x)).max()
    assert err.max() > fp32_slack.max()                            # it did quantize
    codes, scales = quantize_int8(lin.weight)
    exact = x.double() @ (codes.double() * scales.double()[:, None]).T + lin.bias.double()
    assert ((y.double() - exact).abs() <= fp32_slack).all()


def test_int8_linear_bf16_activations_within_the_bound_plus_bf16_rounding():
    """With bf16 activations (a bf16 model) both paths are within the bound plus bf16's own
    rounding of the weight copy and of the output (2^-8 relative)."""
    for k, rows in ((64, 1), (64, KERNEL_MAX_ROWS + 7), (70, 1), (70, 5)):
        lin = _linear(k=k, seed=1).bfloat16()
        q = Int8Linear(lin)
        x = torch.randn(rows, k).bfloat16()
        with torch.inference_mode():
            y = q(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 37)
        w, b = lin.weight.double(), lin.bias.double()
        ref = x.double() @ w.T + b
        mag = x.double().abs() @ w.abs().T + b.abs()
        err = (y.double() - ref).abs()
        assert (err <= _bound(lin, x) + 2 ** -7 * mag).all(), (k, rows)


def _amx_here() -> bool:
    from engine.kernels import load_kernels

    return load_kernels() and torch.ops.streamgate.amx_tiles()


@pytest.mark.skipif(not _amx_here(), reason="no AMX tiles here (CPU, kernel variant or STREAMGATE_AMX=0)")
@pytest.mark.parametrize("k, n, bias", [(64, 37, True), (96, 40, False), (576, 960, True)])
def test_int8_amx_tiles_within_the_bound_and_row_and_thread_invariant(k, n, bias):
    """bf16 steps of more than eight rows run on AMX tiles (csrc/linear_amx.h) where the CPU
    has them: within the quantization bound plus bf16's rounding, as the FMA path (the switch
    off) is; a row's output does not depend on the other rows of the call (16-row tiles, padding
    rows), nor on the number of threads (blocks of outputs split, never a sum)."""
    torch.manual_seed(k + n)
    lin = nn.Linear(k, n, bias=bias).bfloat16()
    w8 = Int8Weight(lin.weight, lin.bias)
    x = torch.randn(100, k).bfloat16()
    ops = torch.ops.streamgate
    w, b = lin.weight.double(), (lin.bias.double() if bias else torch.zeros(n, dtype=torch.double))
    with torch.inference_mode():
        for rows in (7, 16, 17, 33, 100):
            y = w8.linear(x[:rows])
            err = (y.double() - (x[:rows].double() @ w.T + b)).abs()
            mag = x[:rows].double().abs() @ w.abs().T + b.abs()
            assert (err <= _bound(lin, x[:rows]) + 2 ** -7 * mag).all(), rows
            if rows > 8:                                                              # all on the tiles
                assert torch.equal(y, w8.linear(x[:100])[:rows])                    # row-invariant
            ops.amx_tiles(False)
            try:
                fma = w8.linear(x[:rows])
            finally:
                ops.amx_tiles(True)
            assert ((y.double() - fma.double()).abs() <= 2 ** -7 * mag).all()       # the FMA path's value
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = w8.linear(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, w8.linear(x))


def test_quantize_int8_codes_and_scales():
    """Each row's largest weight maps to +-127; a zero row gets codes 0 (no division by zero)."""
    w = torch.randn(6, 9)
    w[3] = 0
    codes, scales = quantize_int8(w)
    assert codes.dtype == torch.int8 and scales.shape == (6,)
    assert codes.abs().amax(1).tolist() == [127, 127, 127, 0, 127, 127]
    assert (codes.float() * scales[:, None] - w).abs().le(scales[:, None] / 2 + 1e-7).all()
    x = torch.randn(1, 9)
    torch.testing.assert_close(Int8Weight(w).linear(x)[0, 3], torch.tensor(0.0))


def _dequantized_reference(model_dir: str):
    """transformers' model with every linear weight replaced by its int8 round trip q * s (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for mod in model.modules():
            if type(mod) is nn.Linear:
                codes, scales = quantize_int8(mod.weight)
                mod.weight.copy_(codes.float() * scales[:, None])
    return model


@pytest.mark.parametrize("family, fused", [("llama", True), ("llama", False), ("qwen2", True)])
def test_engine_with_int8_generates_the_dequantized_models_greedy_tokens(tiny_model, family, fused, monkeypatch):
    """An engine with quantization="int8" (fused Llama forward, or transformers' with Int8Linear
    modules) generates, for four prompts batched together, the greedy tokens of HF `generate` on
    the same model with its linear weights replaced by their int8 round trip (fp32): prefill
    chunks of more than KERNEL_MAX_ROWS rows (dequantized into the scratch buffer), decode
    steps of four, three, two rows and one (the kernel), and steps mixing both. Qwen2: q/k/v
    biases ride in the fused int8 GEMM. The model holds int8 codes, not a dequantized copy."""
    from engine import LLMEngine, SamplingParams
    from engine.fused_llama import FusedLlama

    model_dir = tiny_model(family)
    eng = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, quantization="int8", fused_layers=fused,
                                 max_num_batched_tokens=48, max_num_seqs=4))
    model = eng.runner.model
    if fused:
        assert isinstance(eng.runner.forward, FusedLlama) and eng.runner.forward.lm_head.kind == "int8"
    else:
        assert isinstance(model.lm_head, Int8Linear)
        assert not any(type(m) is nn.Linear for m in model.modules())
    held = [p for p in list(model.parameters()) + list(model.buffers()) if p.dim() == 2 and p.dtype != torch.int8]
    assert [tuple(p.shape) for p in held] == [tuple(model.get_input_embeddings().weight.shape)]   # no float weight but the embedding
    assert int8_bytes(model) > 0
    prompts = {"a": list(range(100, 140)), "b": list(range(300, 309)), "c": list(range(500, 525)), "d": [7, 8, 9]}
    lengths = {"a": 12, "b": 5, "c": 9, "d": 16}
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, SamplingParams(max_tokens=lengths[rid], temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    rows_seen: set[int] = set()
    linear = Int8Weight.linear

    def counting(self, x):
        rows_seen.add(x.reshape(-1, self.in_features).shape[0])
        return linear(self, x)

    monkeypatch.setattr(Int8Weight, "linear", counting)
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert max(rows_seen) > KERNEL_MAX_ROWS and {1, 2, 3, 4} <= rows_seen, sorted(rows_seen)
    ref = _dequantized_reference(model_dir)
    for rid, ids in prompts.items():
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=lengths[rid], do_sample=False,
                               min_new_tokens=lengths[rid])
        assert got[rid] == out[0, len(ids):].tolist(), rid


@pytest.mark.parametrize("bad, match", [
    (dict(quantization="int4"), "EngineConfig.quantization: must be one of"),
    (dict(quantization="INT8"), "EngineConfig.quantization"),
    (dict(quantization="int8", compile=True), "EngineConfig.quantization: int8 runs on CPU"),
    (dict(quantization="int8", tensor_parallel_size=2), "EngineConfig.quantization: int8 runs on CPU"),
    (dict(quantization="int8", device="cuda"), "EngineConfig.quantization: int8 runs on CPU"),
])
def test_quantization_field_is_validated(bad, match):
    """Unknown values and unsupported combinations raise ValueError naming the field."""
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_quantization_flag_reaches_the_engine_config():
    """`--quantization int8` on serve/chat sets EngineConfig.quantization; absent, it is None."""
    import argparse

    from engine.config_cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).quantization is None
    assert engine_config_from_args(p.parse_args(["--quantization", "int8"])).quantization == "int8"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "int4"])
