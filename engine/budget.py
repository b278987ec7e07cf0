"""The step's token budget: fixed, or adapted to an inter-token latency target.

A step's time is close to linear in what it carries:

    step_s ≈ a + b · decodes + c · prefill_tokens

(`a`: per-step overhead; `b`: one decode row, attention over its context included; `c`:
one prompt token). `AdaptiveBudget` fits a, b, c by least squares over the last steps it
was told about, and gives each step as many tokens as fit under a limit once the
decodes are paid for: the target when nothing decodes, and while streams decode the
smaller of the target and twice their decode-only step (a + b · decodes), so a step
never costs more than two of the steps the streams would otherwise get and the
smoothness target (ITL p99 <= 2x p50) holds by construction above the floor. So prefill
drains fast while few streams decode (a dominant per-step overhead `a`, as on a GPU,
gives big chunks) and the budget shrinks as more do, whatever the hardware, model, dtype
or compilation mode: the costs are measured, not configured.

Bounds: never more than `max_step_tokens`, and never less than `max_num_batched_tokens`
(the fixed budget): where the target cannot be met (a slow or busy host, many long
contexts) the step is what it was before, instead of starving prefill to shave a few
milliseconds off a step that is slow anyway. A tighter ITL is a smaller
`max_num_batched_tokens`, as before.
"""

from __future__ import annotations

from collections import deque

from .config import EngineConfig

WINDOW = 48                  # steps the fit remembers: a few seconds of serving
MIN_SAMPLES = 4              # steps seen before the fit replaces the fixed budget
RELATIVE = 2.0               # while streams decode, a step costs at most this many decode-only
                             # steps (the smoothness target: ITL p99 <= 2x p50)
OUTLIER = 4.0                # a step this many times slower than predicted (a compile, a
                             # stall on a shared host) is not learned from


class FixedBudget:
    """`max_num_batched_tokens` every step (`itl_target_ms=None`, and the comparison modes)."""

    def __init__(self, tokens: int):
        self.fixed = tokens

    def tokens(self, num_decodes: int) -> int:
        return self.fixed

    def observe(self, num_decodes: int, num_prefill: int, seconds: float) -> None:
        pass


class AdaptiveBudget(FixedBudget):
    """The largest budget whose predicted step time stays under `target_s`."""

    def __init__(self, tokens: int, target_s: float, ceiling: int):
        super().__init__(tokens)
        self.target_s = target_s
        self.ceiling = ceiling
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        self.coef: tuple[float, float, float] | None = None      # (a, b, c) seconds

    def tokens(self, num_decodes: int) -> int:
        if self.coef is None:
            return self.fixed
        a, b, c = self.coef
        decode_only = a + b * num_decodes
        limit = self.target_s if num_decodes == 0 else min(self.target_s, RELATIVE * decode_only)
        fits = num_decodes + int(max(0.0, limit - decode_only) / c)
        return max(self.fixed, min(fits, self.ceiling))

    def predict(self, num_decodes: int, num_prefill: int) -> float | None:
        if self.coef is None:
            return None
        a, b, c = self.coef
        return a + b * num_decodes + c * num_prefill

    def observe(self, num_decodes: int, num_prefill: int, seconds: float) -> None:
        if num_decodes + num_prefill == 0:
            return
        expected = self.predict(num_decodes, num_prefill)
        if expected is not None and seconds > OUTLIER * expected:
            return
        self.samples.append((num_decodes, num_prefill, seconds))
        if len(self.samples) >= MIN_SAMPLES:
            self.coef = _fit(self.samples) or self.coef


def _fit(samples) -> tuple[float, float, float] | None:
    """Least squares for t = a + b·D + c·P with a small ridge pull towards one shared
    per-token cost, so a window of decode-only steps (P always 0, c unidentifiable) still
    gives a cautious c instead of nothing. Costs are kept non-negative; c strictly positive."""
    n = len(samples)
    per_token = sum(t for _, _, t in samples) / max(1, sum(d + p for d, p, _ in samples))
    prior = (0.0, per_token, per_token)
    rows = [(1.0, float(d), float(p), t) for d, p, t in samples]
    scale = [1.0, max(1.0, sum(r[1] for r in rows) / n), max(1.0, sum(r[2] for r in rows) / n)]
    ridge = 1e-3 * n
    # Normal equations (X'X + ridge·S) θ = X'y + ridge·S·prior, S = diag(scale²).
    m = [[sum(r[i] * r[j] for r in rows) + (ridge * scale[i] ** 2 if i == j else 0.0) for j in range(3)]
         for i in range(3)]
    v = [sum(r[i] * r[3] for r in rows) + ridge * scale[i] ** 2 * prior[i] for i in range(3)]
    theta = _solve(m, v)
    if theta is None:
        return None
    a, b, c = theta
    return max(0.0, a), max(0.0, b), max(c, 0.1 * per_token, 1e-7)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for a 3x3 system."""
    m = [row[:] + [x] for row, x in zip(m, v)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for k in range(col, 4):
                m[r][k] -= f * m[col][k]
    out = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        out[r] = (m[r][3] - sum(m[r][k] * out[k] for k in range(r + 1, 3))) / m[r][r]
    return out


def make_budget(config: EngineConfig):
    """Adaptive for continuous batching with a target; fixed otherwise (the comparison
    modes keep the budget they are defined by: a whole prompt must fit a prefill-first step)."""
    if config.itl_target_ms is None or not config.chunked_prefill or config.batching != "continuous":
        return FixedBudget(config.max_num_batched_tokens)
    return AdaptiveBudget(config.max_num_batched_tokens, config.itl_target_ms / 1000, config.max_step_tokens)
