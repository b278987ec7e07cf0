"""Plain sampling's draw on the kernels (csrc/logits.cpp's `draw_rows`, engine/sampler.py):
the token is the inverse CDF of softmax(logits / temperature) at u * total, as torch's softmax,
cumsum and searchsorted give it, checked against a float64 reference; never a column of zero
probability; a row whose max is not finite takes its argmax; a row's token does not depend on
the rows beside it or on the threads; rows with a top-k or top-p cut keep torch's path; and
seeded draws follow the distribution."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from engine.config import SamplingParams
from engine.kernels import load_kernels
from engine.sampler import drawn_in_kernel, sample

pytestmark = pytest.mark.skipif(not load_kernels(), reason="the C++ kernels did not build")

NAN, INF = float("nan"), float("inf")
WIDTHS = [1, 15, 16, 17, 4095, 4096, 4097, 8200, 49152]       # around 16-lane vectors and 4,096-column spans
MIDDLE = [0.25, 0.5, 0.9]
U = [0.0, 1e-7, *MIDDLE, 0.999, 1.0 - 2.0 ** -24]


def draw(x: torch.Tensor, temperature: float, u: float) -> torch.Tensor:
    n = x.shape[0]
    return torch.ops.streamgate.draw_rows(x, torch.full((n,), temperature), torch.full((n,), u))


def reference(x: torch.Tensor, temperature: float, u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's inverse CDF in float64 of the fp32 y = x / T, and each row's distance (a share of
    the total) from u * total to the nearest cumulative sum: fp32 sums may fall either side
    where that distance is within their rounding."""
    y = (x if temperature == 1.0 else x / temperature).double()
    cdf = torch.softmax(y, dim=-1).cumsum(dim=-1)
    target = u * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=x.shape[1] - 1), \
        (cdf - target).abs().min(dim=-1).values / cdf[:, -1]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
def test_draw_rows_takes_the_inverse_cdf_torch_gives(width, temperature):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(4, width, generator=g) * 4
    x[1] = (x[1] * 2).round()                              # ties
    compared = 0
    for u in U:
        got = draw(x, temperature, u)
        want, margin = reference(x, temperature, u)
        close = margin < 1e-5
        assert torch.equal(got[~close], want[~close]), (u, got, want)
        assert bool(((got >= 0) & (got < width)).all())
        if u in MIDDLE:
            compared += int((~close).sum())
    assert compared >= 0.9 * 4 * len(MIDDLE)                  # the rounding band is rare away from u's ends


def test_columns_of_zero_probability_are_never_drawn():
    x = torch.full((3, 9000), -INF)
    x[0, 3], x[1, 8999], x[2, [10, 5000]] = 1.0, 0.0, torch.tensor([2.0, 2.0])
    x[2, 6000] = -200.0                                     # exp(-202) underflows: probability zero
    for u in U:
        got = draw(x, 1.0, u).tolist()
        assert got[0] == 3 and got[1] == 8999 and got[2] in (10, 5000)
    assert draw(x, 1.0, 0.0)[2] == 10 and draw(x, 1.0, 0.75)[2] == 5000


def test_a_row_whose_max_is_not_finite_takes_its_argmax():
    x = torch.randn(3, 5000)
    x[0] = -INF                                             # nothing to draw from: index 0, as argmax
    x[1, 4321], x[1, 4400] = NAN, NAN                       # the first NaN
    x[2, 77] = INF
    assert draw(x, 1.0, 0.5).tolist() == [0, 4321, 77]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: no helper thread to share loops with")
def test_a_rows_token_does_not_depend_on_its_neighbours_or_the_threads():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 49152, generator=g) * 3
    temps, u = torch.rand(8, generator=g) + 0.5, torch.rand(8, generator=g)
    together = torch.ops.streamgate.draw_rows(x, temps, u)
    alone = [int(torch.ops.streamgate.draw_rows(x[i:i + 1], temps[i:i + 1], u[i:i + 1])) for i in range(8)]
    assert together.tolist() == alone
    torch.ops.streamgate.elastic_threads(3)
    try:
        assert torch.equal(torch.ops.streamgate.draw_rows(x, temps, u), together)
    finally:
        torch.ops.streamgate.elastic_threads(0)


def test_rows_with_a_cut_keep_torchs_path_and_the_others_take_the_kernel():
    logits = torch.zeros(1, 10)
    assert drawn_in_kernel(logits, SamplingParams(temperature=0.8))
    assert drawn_in_kernel(logits, SamplingParams(temperature=0.8, top_k=10))        # k >= V: no cut
    for cut in (dict(top_k=3), dict(top_p=0.9)):
        assert not drawn_in_kernel(logits, SamplingParams(**cut))
    assert not drawn_in_kernel(logits, SamplingParams(temperature=0.0))
    assert not drawn_in_kernel(logits.bfloat16(), SamplingParams())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_seeded_draws_follow_the_distribution(temperature):
    """4,000 draws of the kernel's path (temperature 1 and 0.5) within 0.03 of softmax(x / T),
    next to a greedy row and a top-p row in the same call."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(p).repeat(3, 1)
    plain = SimpleNamespace(params=SamplingParams(temperature=temperature, seed=3), generator=None)
    greedy = SimpleNamespace(params=SamplingParams(temperature=0.0), generator=None)
    cut = SimpleNamespace(params=SamplingParams(temperature=1.0, top_p=0.6, seed=4), generator=None)
    counts = torch.zeros(4)
    for _ in range(4000):
        token, best, kept = sample(logits, [plain, greedy, cut])
        counts[token] += 1
        assert best == 0 and kept in (0, 1)
    want = p ** (1 / temperature)
    assert torch.allclose(counts / 4000, want / want.sum(), atol=0.03)


def test_draw_rows_refuses_what_it_cannot_read():
    ok = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="draw_rows: logits must be"):
        torch.ops.streamgate.draw_rows(ok.bfloat16(), torch.ones(2), torch.zeros(2))
    with pytest.raises(RuntimeError, match="draw_rows: logits must be"):
        torch.ops.streamgate.draw_rows(torch.zeros(2, 0), torch.ones(2), torch.zeros(2))
    with pytest.raises(RuntimeError, match="draw_rows: temps and u must be"):
        torch.ops.streamgate.draw_rows(ok, torch.ones(3), torch.zeros(2))
