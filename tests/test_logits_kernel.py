"""The step's logits on the kernels' threads (csrc/logits.cpp): `argmax_rows` picks the index
torch's `argmax` picks (the first of tied maxima, the first NaN, index 0 of a row of -inf) in
fp32 and bf16, across its column spans and over strided rows, on OpenMP's loops and on the
elastic pool; `logits_fp32` widens bf16 exactly; both refuse what they cannot read."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kernels import load_kernels, logits_fp32
from engine.sampler import greedy

pytestmark = pytest.mark.skipif(not load_kernels(), reason="the C++ kernels did not build")

NAN, INF = float("nan"), float("inf")
# Widths around the kernel's 16-lane vectors and its 4,096-column spans, and SmolLM2's vocabulary.
WIDTHS = [1, 15, 16, 17, 4095, 4096, 4097, 8200, 49152]


def cases(width: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=g)
    ties = (x * 2).round()                               # many equal maxima, in bf16 too
    special = x.clone()
    special[0] = -INF                                    # a fully masked row: index 0
    special[1, width // 2] = NAN                         # a NaN is the maximum, the first one wins
    special[1, width - 1] = NAN
    special[2, width - 1] = INF                          # the maximum in the last column (a tail)
    special[3] = 7.0                                     # all tied: the first
    special[4, : width // 2] = -INF                      # the maximum past the first span
    if width > 4096:
        special[5, 4096] = NAN                           # a NaN in a later span than an earlier max
        special[5, 10] = 1e30
    return [t.to(dtype) for t in (x, ties, special)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", WIDTHS)
def test_argmax_rows_picks_what_argmax_picks(width, dtype):
    for x in cases(width, dtype):
        want = x.float().argmax(dim=-1)
        assert torch.equal(torch.ops.streamgate.argmax_rows(x), want)
        assert torch.equal(greedy(x), want)                    # the sampler's greedy takes it
        assert torch.equal(torch.ops.streamgate.argmax_rows(x[:, : max(1, width - 3)]),
                           x[:, : max(1, width - 3)].float().argmax(dim=-1))     # rows strided


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: no helper thread to share loops with")
def test_argmax_and_widening_on_the_elastic_pool_match_openmps():
    """The pool splits a row's spans over threads; the spans combine in column order, so the
    first maximum still wins whoever ran which span."""
    xs = [c for w in (4097, 49152) for dt in (torch.float32, torch.bfloat16) for c in cases(w, dt)]
    want = [x.float().argmax(dim=-1) for x in xs]
    torch.ops.streamgate.elastic_threads(3)
    try:
        for x, w in zip(xs, want):
            assert torch.equal(torch.ops.streamgate.argmax_rows(x), w)
            if x.dtype == torch.bfloat16:
                assert torch.equal(torch.ops.streamgate.logits_fp32(x).view(torch.int32), x.float().view(torch.int32))
    finally:
        torch.ops.streamgate.elastic_threads(0)


@pytest.mark.parametrize("width", [1, 17, 4097, 49152])
def test_logits_fp32_widens_bf16_exactly(width):
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[0, 0], x[1, -1], x[2, 0] = NAN, -INF, 1e-40                # NaN, infinities and a subnormal kept
    for y in (x, x[:, : max(1, width - 2)]):
        got = logits_fp32(y)
        assert got.dtype == torch.float32 and got.shape == y.shape
        assert torch.equal(got.view(torch.int32), y.float().view(torch.int32))
    assert logits_fp32(x.float()).dtype == torch.float32                    # fp32 passes through


def test_the_logits_operators_refuse_what_they_cannot_read():
    with pytest.raises(RuntimeError, match="argmax_rows: logits must be"):
        torch.ops.streamgate.argmax_rows(torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="argmax_rows: logits must be"):
        torch.ops.streamgate.argmax_rows(torch.zeros(8))
    with pytest.raises(RuntimeError, match="at least one column"):
        torch.ops.streamgate.argmax_rows(torch.zeros(3, 0))
    with pytest.raises(RuntimeError, match="logits_fp32: x must be"):
        torch.ops.streamgate.logits_fp32(torch.zeros(4, 8))
