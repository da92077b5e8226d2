"""Contiguous layer ranges, one per stage (GPU)."""
from __future__ import annotations

import numpy as np


def split_layers(num_layers: int, parts: list[int] | int) -> list[range]:
    """Contiguous layer ranges: ``parts`` is a count (even split) or explicit layer counts."""
    if isinstance(parts, int):
        base, extra = divmod(num_layers, parts)
        parts = [base + (1 if i < extra else 0) for i in range(parts)]
    if sum(parts) != num_layers or any(p <= 0 for p in parts):
        raise ValueError(f"layer split {parts} does not cover {num_layers} layers")
    bounds = np.cumsum([0] + list(parts))
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def proportional_split(num_layers: int, weights: list[float]) -> list[int]:
    """Layer counts proportional to ``weights``, each >= 1, summing to num_layers."""
    total = float(sum(weights)) or 1.0
    counts = [max(1, int(num_layers * w / total)) for w in weights]
    while sum(counts) > num_layers:
        counts[counts.index(max(counts))] -= 1
    order = sorted(range(len(weights)), key=lambda i: num_layers * weights[i] / total - counts[i], reverse=True)
    for i in order[: num_layers - sum(counts)]:
        counts[i] += 1
    return counts
