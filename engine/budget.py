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
    gives a cautious c instead of nothing; c is at least a tenth of that per-token cost.

    Non-negative: where the unconstrained optimum has a negative cost, the best fit with that
    cost held at 0 (every subset of held costs tried: three unknowns). Clamping the optimum
    instead leaves the others fitted to a negative partner: four start-up steps (a 256-token
    prefill slowed by first touches, 306 ms; 8 decodes + 248 tokens, 155 ms; 15 + 8, 40 ms;
    16 decodes, 19 ms) solved to a = 0.31 s, b = -0.018, c = -2e-5, clamped to c = 9e-5 s a
    token, against ~8e-4 measured, and the next step carried 2,000 prompt tokens (1.9 s,
    Zen 4, 2026-12-06, bench.engine.scheduling smoothness)."""
    n = len(samples)
    per_token = sum(t for _, _, t in samples) / max(1, sum(d + p for d, p, _ in samples))
    prior = (0.0, per_token, per_token)
    rows = [(1.0, float(d), float(p), t) for d, p, t in samples]
    scale = [1.0, max(1.0, sum(r[1] for r in rows) / n), max(1.0, sum(r[2] for r in rows) / n)]
    ridge = [1e-3 * n * scale[i] ** 2 for i in range(3)]
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]      # X'X, once
    xty = [sum(r[i] * r[3] for r in rows) for i in range(3)]                           # X'y
    yty = sum(r[3] * r[3] for r in rows)
    best, best_cost = None, None
    for free in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
        # Normal equations over the free costs (X'X + ridge·S) θ = X'y + ridge·S·prior; the rest 0.
        m = [[gram[i][j] + (ridge[i] if i == j else 0.0) for j in free] for i in free]
        sol = _solve(m, [xty[i] + ridge[i] * prior[i] for i in free])
        if sol is None or min(sol) < 0.0:
            continue
        theta = [0.0, 0.0, 0.0]
        for i, x in zip(free, sol):
            theta[i] = x
        # |y - Xθ|² + Σ ridge_i (θ_i - prior_i)², from X'X and X'y
        cost = (yty - 2 * sum(theta[i] * xty[i] for i in range(3))
                + sum(theta[i] * gram[i][j] * theta[j] for i in range(3) for j in range(3))
                + sum(ridge[i] * (theta[i] - prior[i]) ** 2 for i in range(3)))
        if best_cost is None or cost < best_cost:
            best, best_cost = theta, cost
        if len(free) == 3:
            break                                   # the unconstrained optimum is feasible
    if best is None:
        return None
    a, b, c = best
    return a, b, max(c, 0.1 * per_token, 1e-7)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for a small square system."""
    k = len(v)
    m = [row[:] + [x] for row, x in zip(m, v)]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            for j in range(col, k + 1):
                m[r][j] -= f * m[col][j]
    out = [0.0] * k
    for r in reversed(range(k)):
        out[r] = (m[r][k] - sum(m[r][j] * out[j] for j in range(r + 1, k))) / m[r][r]
    return out


def make_budget(config: EngineConfig):
    """Adaptive for continuous batching with a target; fixed otherwise (the comparison
    modes keep the budget they are defined by: a whole prompt must fit a prefill-first step)."""
    if config.itl_target_ms is None or not config.chunked_prefill or config.batching != "continuous":
        return FixedBudget(config.max_num_batched_tokens)
    return AdaptiveBudget(config.max_num_batched_tokens, config.itl_target_ms / 1000, config.max_step_tokens)
