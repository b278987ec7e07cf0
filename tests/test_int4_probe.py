"""bench.engine.int4_probe's quantizer: the int4 numbers its perplexities are measured on."""

import torch

from bench.engine.int4_probe import fake_int4


def test_symmetric_codes_and_error():
    torch.manual_seed(0)
    w = torch.randn(8, 64) * torch.logspace(-3, 0, 8)[:, None]          # rows of very different scales
    deq, codes, scale = fake_int4(w, 16, symmetric=True)
    assert codes.min() >= -8 and codes.max() <= 7
    assert torch.equal(deq, codes * scale.repeat_interleave(16, dim=1))
    err = (w - deq).abs().reshape(8, 4, 16).amax(-1)
    assert (err <= scale / 2 * (1 + 1e-3)).all()                          # round to nearest, nothing clamped
    # each group's largest magnitude is code +-7 (scale = max|w| / 7, rounded to fp16)
    assert (codes.abs().reshape(8, 4, 16).amax(-1) == 7).all()


def test_asymmetric_codes_and_error():
    torch.manual_seed(1)
    w = torch.rand(4, 32) * 3 + 1                                          # all positive: a zero point pays
    deq, codes, scale = fake_int4(w, 32, symmetric=False)
    assert codes.min() >= 0 and codes.max() <= 15
    sym = fake_int4(w, 32, symmetric=True)[0]
    assert (w - deq).abs().mean() < (w - sym).abs().mean()               # 16 levels over [min, max] vs [-max, max]
    assert ((w - deq).abs() <= scale.repeat_interleave(32, dim=1) * (1 + 1e-3)).all()


def test_exact_values():
    w = torch.tensor([[-7.0, 0.0, 3.5, 7.0]])
    deq, codes, scale = fake_int4(w, 4, symmetric=True)
    assert scale.item() == 1.0
    assert codes.tolist() == [[-7.0, 0.0, 4.0, 7.0]]                     # 3.5 rounds half to even
    assert deq.tolist() == [[-7.0, 0.0, 4.0, 7.0]]
