"""KV-cache groups: which layers share a block table (as vLLM's hybrid KV cache manager).

A model whose layers all attend alike has one group of all its layers: a block holds every
layer's keys and values for `block_size` tokens. A hybrid model (Gemma 2/3, gpt-oss, ...:
some layers slide over a window, the others see the whole context) splits its layers by
window into groups of equal size, so that a block is the same size in every group and one
pool serves them all: the pool is `[group size, slots, H_kv, D]` and layer l reads row
`layer_row[l]` of the blocks in its group's table. A sliding group gives back the blocks
that fell out of its window (block_manager.py) while the full group keeps them, so a long
conversation holds `window` tokens of KV per sliding layer, not the whole context.

The size (vLLM's rule): the smallest layer count of any window, unless every count is within
1.25x of the largest (then the largest, padding the short groups: fewer tables per step for a
few unused rows). Gemma 3 (5 sliding : 1 full) gets six groups of its full layers' count;
gpt-oss (1 : 1) two groups of half its layers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]        # per group: its layers' window; None: full attention
    layers: tuple[tuple[int, ...], ...]    # per group: its layers
    rows: int                              # layers per group: the pool's rows per block

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Per layer, its group."""
        return tuple(g for _, g in sorted((layer, g) for g, ls in enumerate(self.layers) for layer in ls))

    @property
    def layer_row(self) -> tuple[int, ...]:
        """Per layer, its row in the pool."""
        return tuple(r for _, r in sorted((layer, r) for ls in self.layers for r, layer in enumerate(ls)))


def plan_groups(windows: tuple[int | None, ...]) -> KVGroups:
    """Groups for a model whose layer i slides over windows[i] (None: full attention); full
    attention first, then windows in ascending order."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    if len(by_window) == 1:
        (window, layers), = by_window.items()
        return KVGroups((window,), (tuple(layers),), len(layers))
    counts = [len(v) for v in by_window.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    group_windows: list[int | None] = []
    group_layers: list[tuple[int, ...]] = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        layers = by_window[window]
        for i in range(0, len(layers), size):
            group_windows.append(window)
            group_layers.append(tuple(layers[i:i + size]))
    return KVGroups(tuple(group_windows), tuple(group_layers), size)
