"""The fewest misses any expert cache could have on a trace: Belady's MIN with bypass (an offline
optimum that knows every later step), for ``moebus bench cache --policies min``. Not a policy: a
bound to measure the online ones against.

Each step reads a set of keys (layer row * experts + expert). A key not resident is a miss, read in
place; after the step, each missed key whose next use comes sooner than the resident farthest from
its next use takes that one's slot (admissions are free here: the bound counts misses, and with
admissions that cost a copy no policy does better). MIN with bypass is optimal for unit-sized keys."""
from __future__ import annotations

import heapq

import numpy as np

NEVER = 1 << 62


def step_keys(trace: np.ndarray, num_experts: int) -> list[np.ndarray]:
    """Each step's distinct keys, from a (steps, layers, T, A) trace of expert ids."""
    rows = np.arange(trace.shape[1], dtype=np.int64)[:, None, None]
    return [np.unique((rows * num_experts + step).reshape(-1)) for step in trace.astype(np.int64)]


def next_uses(keys: list[np.ndarray]) -> list[dict[int, int]]:
    """For each step, each of its keys' next step of use (NEVER: none)."""
    later: dict[int, int] = {}
    out: list[dict[int, int]] = [{} for _ in keys]
    for step in range(len(keys) - 1, -1, -1):
        out[step] = {int(k): later.get(int(k), NEVER) for k in keys[step]}
        for k in keys[step]:
            later[int(k)] = step
    return out


def min_misses(trace: np.ndarray, num_experts: int, slots: int, shrink_at: int | None = None,
               shrink_to: int | None = None) -> np.ndarray:
    """(steps, 2): hits and misses a step with ``slots`` (``shrink_to`` from ``shrink_at`` on), the cache
    starting with the keys used first (a preload that knew)."""
    keys = step_keys(trace, num_experts)
    following = next_uses(keys)
    first: dict[int, int] = {}
    for step, ks in enumerate(keys):
        for k in ks:
            first.setdefault(int(k), step)
    resident = dict(sorted(first.items(), key=lambda kv: kv[1])[:slots])  # key -> its next use
    out = np.zeros((len(keys), 2), np.int64)
    for step, ks in enumerate(keys):
        if step == shrink_at and shrink_to is not None and shrink_to < slots:
            slots = shrink_to
            resident = dict(sorted(resident.items(), key=lambda kv: kv[1])[:slots])  # keeps the soonest
        missed = [int(k) for k in ks if int(k) not in resident]
        out[step] = len(ks) - len(missed), len(missed)
        uses = following[step]
        for k in ks:
            if int(k) in resident:
                resident[int(k)] = uses[int(k)]
        farthest = [(-use, k) for k, use in resident.items()]
        heapq.heapify(farthest)
        for use, k in sorted((uses[k], k) for k in missed):
            if use == NEVER:
                break
            if len(resident) < slots:
                resident[k] = use
                heapq.heappush(farthest, (-use, k))
                continue
            while farthest and resident.get(farthest[0][1]) != -farthest[0][0]:
                heapq.heappop(farthest)  # stale: that key was evicted or used since
            if not farthest or -farthest[0][0] <= use:
                break  # sorted soonest first: the rest come later still
            _, victim = heapq.heappop(farthest)
            del resident[victim]
            resident[k] = use
            heapq.heappush(farthest, (-use, k))
    return out
