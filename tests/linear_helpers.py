"""Helpers shared by the weight-streaming linear kernels' tests (tests/test_linear_bf16.py,
tests/test_linear_int8.py): test weights, and the fp64 reference with the largest error an
fp32-accumulating kernel may make."""

from __future__ import annotations

import torch

U = 2.0 ** -24                   # fp32 unit roundoff


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 weight [n, k] whose output channels span three decades, and a bias [n]."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]
    return w, torch.randn(n, generator=g)


def reference_and_tolerance(x: torch.Tensor, w: torch.Tensor, bias, out_dtype, roundings: int = 2):
    """x @ w^T + b in fp64 from the weight the product should use, the bound on an
    fp32-accumulating kernel's error and sum |x||w| + |b|. The bound: K products summed in
    any order plus `roundings` more fp32 roundings (the bias; a scale and the dequantized
    weight's own rounding), gamma_{K+roundings} relative to sum |x||w| + |b|; a bf16 or fp16
    output adds the rounding of the result (2^-8 or 2^-11 relative; fp16's subnormals, below
    2^-14, are rounded to a multiple of 2^-24: half of that absolute)."""
    xd, w = x.double(), w.double()
    ref = xd @ w.T + (0 if bias is None else bias.double())
    mag = xd.abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    n = x.shape[1] + roundings
    tol = n * U / (1 - n * U) * mag
    out_u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(out_dtype)
    if out_u:
        tol = tol + out_u * (ref.abs() + tol) + (2.0 ** -25 if out_dtype == torch.float16 else 0.0)
    return ref, tol, mag


def assert_rows_invariant(linear, x: torch.Tensor) -> None:
    """Every row of `linear(x)` has exactly the bits of that row computed alone, and of it
    computed among every shorter prefix of x: a kernel whose sum for a row depends on how many
    rows share the call would let a one-row decode and the same position verified among
    drafts (or batched with other sequences) round differently (speculative greedy output
    must equal the plain run's)."""
    alone = torch.cat([linear(x[i:i + 1]) for i in range(x.shape[0])])
    for m in range(2, x.shape[0] + 1):
        got = linear(x[:m])
        bad = (got.view(torch.int16 if got.element_size() == 2 else torch.int32)
               != alone[:m].view(torch.int16 if got.element_size() == 2 else torch.int32)).any(dim=1)
        assert not bad.any(), f"{m} rows: rows {bad.nonzero().flatten().tolist()} differ from the row alone"
