"""`max_num_batched_tokens=None` ("auto"): the step's token budget measured on this host at start.

A prompt token's cost falls as a step carries more of them, until the step's matmuls reach
the host's compute bound, and then stays flat: past that knee a bigger step buys no
throughput and only makes every decoding stream wait longer for its next token. Where the
knee sits depends on the host (a CPU's cores, whether it has AMX tiles, its memory bandwidth;
a GPU's), the model and its dtype, so a fixed 512 is right on few of them. The engine measures
its own curve instead: a prompt of each size on `LADDER` (from `max_num_seqs`, which every
step must hold, up to the largest that fits, and `FIT_RUNG` below it, timed for the fit only)
runs as one step, in `ROUNDS` rounds that alternate the sizes so that a shared host's slow
minutes fall on every size alike. Each size's time per token is the median of its rounds, and
the curve is fitted as b + a / size by least squares: b what a token costs once the step's
matmuls are full, a the step's fixed cost (scheduling, sampling, small matmuls' waste). The
budget is the smallest size whose fitted cost per token is within `TOLERANCE` of b, and no
larger than the largest size whose step took at most `MAX_CHOSEN_STEP_S`. A size whose step
takes longer than `MAX_STEP_S` ends the ladder: such a step stalls every stream.

On Zen 4 (2 cores, bf16, SmolLM2-135M) the probe measured 1475 / 1495 / 1541 / 1544 / 1534 /
1493 prompt tok/s at steps of 64 / 128 / 256 / 512 / 1,024 / 2,048 tokens: a flat curve (two
cores' matmuls are compute-bound from a few dozen rows). The tolerance is small because a
flat curve's smallest size is not free when served: fewer streams decode at once, and each
step's fixed work (scheduling, sampling, streaming on the same cores) recurs more often
(docs/BENCHMARKS.md §2).

Why a fit: on such a flat curve the sizes from 128 up differ by less than the host's noise
(a size's three rounds fall 2-22 % apart on Zen 4), and picking among them by their own times
let the noise choose. The rule until 2026-12-07 (each size's best round, the smallest within
2 % of the best size's) chose 512 / 128 / 256 / 512 / 512 in five probes on Zen 4 (2026-12-07,
`max_num_seqs` 64) and 1,024 in a sixth, whose prompt steps stalled every stream for ~1 s;
medians on a non-rising curve (`3d75944`) chose 256 / 128 / 1,024 / 512 / 512 on the same
rounds. The fit, over all sizes from 32 tokens, chose 512 in all five, and in four probes
from a 16-token floor (`max_num_seqs` 16) too; from 64 tokens without the 32-token rung the
fit chose 1,024 / 1,024 / 512 / 512 / 512: the small sizes are what pin a down.

No torch here: the probe times the engine's own steps (`LLMEngine.step`), whatever the
device, dtype, attention backend or compilation mode. The engine builds its scheduler again
after the probe, so its requests leave no trace in the stats, the prefix cache or the
metrics.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from .config import SamplingParams

LADDER = (64, 128, 256, 512, 1024, 2048)
PIECE = 32                   # tokens per probe prompt, at least
FIT_RUNG = 32                # a size below the floor timed for the fit only
ROUNDS = 3                   # rounds after the warm one (first steps at a new size build kernels)
TOLERANCE = 0.02             # the budget's fitted time per token may exceed b by this fraction
MAX_STEP_S = 2.0             # a size slower than this ends the ladder
MAX_CHOSEN_STEP_S = 1.0      # the budget's own step takes at most this (median), whatever the fit says


@dataclass(frozen=True)
class BudgetProbe:
    tokens: int                                              # the budget chosen
    per_token_s: dict[int, float] = field(default_factory=dict)   # size -> median step time / size

    def describe(self) -> str:
        rate = ", ".join(f"{m}: {1 / s:.0f}" for m, s in sorted(self.per_token_s.items()))
        return f"token budget {self.tokens} measured (prompt tok/s by step size: {rate})"


def ladder(floor: int, ceiling: int) -> list[int]:
    """The sizes to time: `LADDER`'s within [floor, ceiling], and `floor` itself first if it
    is not on it (a budget below `max_num_seqs` could not hold every decode row)."""
    sizes = [m for m in LADDER if floor <= m <= ceiling]
    return sizes if sizes and sizes[0] == floor else [floor, *sizes]


def fit(per_token_s: dict[int, float]) -> tuple[float, float]:
    """(a, b) of the least-squares line per_token = b + a / size through the sizes' times."""
    xs, ys = [1 / m for m in per_token_s], list(per_token_s.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return a, my - a * mx


def choose(per_token_s: dict[int, float], tolerance: float = TOLERANCE, floor: int = 0,
           max_step_s: float = MAX_CHOSEN_STEP_S) -> int:
    """The smallest size of at least `floor` whose cost per token on the fitted b + a / size is
    within `tolerance` of b (the largest size if none is; the smallest if steps have no fixed
    cost to spread, a <= 0), but no larger than the largest size whose measured step took at
    most `max_step_s` (a prompt step stalls every decoding stream for its length): where a
    step's fixed cost is large, the fit's knee lies past any step a stream should wait for.
    On the Intel Ice Lake host (bf16, 2026-12-07, `66704d9`, when bf16 steps of 80+ rows widened
    every layer's weights for MKL's GEMM, ~60 ms a step) the curve kept falling to 2,048 tokens,
    and that budget's 2,000-token prompt steps stalled 16 decoding streams for 4.2 s."""
    sizes = sorted(m for m in per_token_s if m >= floor)
    a, b = fit(per_token_s)
    if a <= 0 or b <= 0:
        knee = sizes[0] if a <= 0 else sizes[-1]
    else:
        knee = next((m for m in sizes if a / m <= tolerance * b), sizes[-1])
    quick = [m for m in sizes if m * per_token_s[m] <= max_step_s]
    return min(knee, quick[-1]) if quick else sizes[0]


def pieces(size: int, max_seqs: int) -> list[int]:
    """`size` prompt tokens as prompts of `PIECE` tokens or more (at most `max_seqs` of them):
    the step's matmuls see all `size` rows, while its attention stays as small as a chunk's
    share of a long prompt's (whose total does not depend on how the prompt is chunked)."""
    n = max(1, min(max_seqs, size // PIECE))
    return [size // n + (i < size % n) for i in range(n)]


def measure(engine, floor: int, ceiling: int, seed: int = 0) -> BudgetProbe:
    """Time one step of each ladder size's prompt tokens through `engine` (whose budget is
    at least `ceiling`); the engine must be idle, and is left with nothing queued."""
    rng = random.Random(seed)
    sizes, rounds = ladder(floor, ceiling), {}
    if FIT_RUNG < sizes[0]:
        sizes = [FIT_RUNG, *sizes]
    for r in range(ROUNDS + 1):
        for m in list(sizes):
            if m not in sizes:                                       # past a size that ended the ladder
                break
            for i, n in enumerate(pieces(m, engine.config.max_num_seqs)):
                engine.add_request(f"budget-probe-{r}-{m}-{i}", [rng.randrange(engine.vocab_size) for _ in range(n)],
                                   SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            seconds = 0.0
            while engine.has_unfinished():
                engine.step()
                seconds += engine.step_time_s
            if r:
                rounds.setdefault(m, []).append(seconds)
            if seconds > MAX_STEP_S * (1 if r else 4) and m > floor:         # (the warm round: kernels build)
                sizes = sizes[:sizes.index(m) + 1]
    per_token = {m: statistics.median(rounds[m]) / m for m in sizes}
    return BudgetProbe(choose(per_token, floor=floor), per_token)
