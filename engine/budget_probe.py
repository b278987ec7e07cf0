"""`max_num_batched_tokens=None` ("auto"): the step's token budget measured on this host at start.

A prompt token's cost falls as a step carries more of them, until the step's matmuls reach
the host's compute bound, and then stays flat: past that knee a bigger step buys no
throughput and only makes every decoding stream wait longer for its next token. Where the
knee sits depends on the host (a CPU's cores, whether it has AMX tiles, its memory bandwidth;
a GPU's), the model and its dtype, so a fixed 512 is right on few of them. The engine measures
its own curve instead: a prompt of each size on `LADDER` (from `max_num_seqs`, which every
step must hold, up to the largest that fits) runs as one step, in `ROUNDS` rounds that
alternate the sizes so that a shared host's slow minutes fall on every size alike, and the
budget is the smallest size whose best time per token is within `TOLERANCE` of the best
size's. A size whose step takes longer than `MAX_STEP_S` ends the ladder: such a step stalls
every stream.

On Zen 4 (2 cores, bf16, SmolLM2-135M) the probe measured 1475 / 1495 / 1541 / 1544 / 1534 /
1493 prompt tok/s at steps of 64 / 128 / 256 / 512 / 1,024 / 2,048 tokens: a flat curve (two
cores' matmuls are compute-bound from a few dozen rows), whose 2% budget is 256. The tolerance
is small because a flat curve's smallest size is not free when served: fewer streams decode
at once, and each step's fixed work (scheduling, sampling, streaming on the same cores) recurs
more often (docs/BENCHMARKS.md §2).

Each size's time is the median of its rounds, and the curve chosen from is the closest one
that never rises with the step size (a bigger step spreads its fixed work over more tokens and
fills its matmuls better, so its cost per token cannot truly be higher). On a flat curve the
noise of a shared host decided the choice by the best single round, as a minimum: on Zen 4
(2026-12-07) four probes back to back chose 256, 128, 512 and 512 and a fifth 1,024, whose
steps stalled every stream for ~1 s; from the same four probes' rounds, medians under the
non-rising curve choose 256, 512, 256 and 512.

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
ROUNDS = 3                   # rounds after the warm one (first steps at a new size build kernels)
TOLERANCE = 0.02             # the budget's time per token may exceed the best by this fraction
MAX_STEP_S = 2.0             # a size slower than this ends the ladder


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


def non_rising(values: list[float]) -> list[float]:
    """The closest sequence (least squares) to `values` that never rises: adjacent violators
    pooled into their mean, as isotonic regression does."""
    pools: list[list[float]] = []                           # [sum, count] of each pooled run
    for v in values:
        pools.append([v, 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] < pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    return [total / count for total, count in pools for _ in range(count)]


def choose(per_token_s: dict[int, float], tolerance: float = TOLERANCE) -> int:
    """The smallest size whose time per token, on the non-rising curve through the sizes' times,
    is within `tolerance` of the curve's lowest."""
    sizes = sorted(per_token_s)
    curve = dict(zip(sizes, non_rising([per_token_s[m] for m in sizes])))
    best = min(curve.values())
    return min(m for m, s in curve.items() if s <= best * (1 + tolerance))


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
            if seconds > MAX_STEP_S * (1 if r else 4) and m != sizes[0]:     # (the warm round: kernels build)
                sizes = sizes[:sizes.index(m) + 1]
    per_token = {m: statistics.median(rounds[m]) / m for m in sizes}
    return BudgetProbe(choose(per_token), per_token)
