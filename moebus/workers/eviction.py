"""Eviction and admission policies of the expert cache. A policy orders resident keys; the cache asks
it for a victim among those it may evict (not pinned), and, on the decode path where a miss is read
straight from host memory and admission is optional, whether a missed key is worth a victim's slot.

- ``lru``: least recently used first; every miss is admitted. Collapses once one step's experts
  outnumber the slots: it evicts exactly what the next layers need.
- ``freq`` (default): a frequency count per key that decays every step (recent use weighs more, a
  key used once long ago fades), kept for keys that are not resident too. A miss is admitted only
  when its count beats the weakest resident's, so a scan of one-off experts never flushes the hot
  set (TinyLFU-style admission); the victim is the resident key with the lowest count.

  ``MOEBUS_CACHE_DECAY`` (default 0.98; 0.9 before the twenty-eighth session): the count's factor a
  step, a memory of ~50 steps (0.9: ~10). With ~10 steps an expert used a few times a while ago lost
  to one used twice just now, so the cache kept copying in experts the next steps did not use again,
  over the link the misses are read over. Replayed through this cache (``moebus bench cache --trace
  streams --landing ahead``: the two greedy text streams of ``bench vision-cycle`` on its 8 × 128
  A3B-shaped LLaVA, 675 slots, 541 from token 217 on as through an image), 0.98 moves 15 % fewer
  experts over PCIe a step before the shrink (15.7 against 18.5) and 17 % fewer after it (28.2
  against 34.0), its slowest 10 % of steps 25 % fewer (38 against 51), with hit rates a point
  higher; at 0.9 the replay's 18.5 a step is near the H200's own logs of that cycle (20.4 a step
  before the image, twenty-sixth session). On ``bench cache``'s synthetic Qwen-like traces and the
  demo model's, with admissions landing as on a GPU, 0.98 moves 1-13 % fewer experts a step with a
  hit rate up to 2 points higher; landing at once (cpu), the synthetic batch 1 loses up to 2.7
  points of hits (recency pays there) for 4-10 % fewer bytes. docs/performance.md, twenty-eighth
  session. A value outside (0, 1] stops the worker's start with a config error.

  ``MOEBUS_ADMISSION_MARGIN`` (default 1): a miss must beat the weakest resident's count by more
  than this to be admitted. A miss's count has just grown by one, so with a margin of 0 and
  near-uniform routing (a randomly initialised model) nearly every miss beats a resident unused for
  a few steps, and the cache copies in up to its cap every step with no gain in hits; misses read in
  place and those copies share one PCIe link. On the H200 (8 × 128 A3B-shaped LLaVA under an 8 GiB
  budget, two text streams through a cold image; docs/performance.md, eighth session) a margin of 1
  moved 33-52 % fewer bytes over PCIe a decode step (steady 314 → 199 MiB, with the smaller cache
  of an image 408-555 → 198-324) for fewer misses; the steps of the steady state kept their time
  (6.5 / 6.6 ms), those beside the image's hand-back, start and encode took 28-44 % less (12.3 →
  6.9, 12.7 → 9.1, 21.2 → 13.6 ms): there the link was the bottleneck. On ``bench cache``'s
  skewed traces it moved fewer too but in one case (1.9 → 2.0 a step), hit rates within a point.
  The shrink's moves (``worth_keeping``) use no margin: a move is a device copy, not a PCIe one.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable

import numpy as np

from moebus.common.env_switches import number_from_env

POLICIES = ("freq", "lru")


def cache_decay_from_env(environ=os.environ) -> float:
    """``MOEBUS_CACHE_DECAY`` (default 0.98): the freq policy's count factor a step, in (0, 1], else a
    ConfigError naming it, raised where a cache is built (a worker's start), not at import."""
    return number_from_env("MOEBUS_CACHE_DECAY", "0.98", "the freq policy's use count is multiplied by it every step",
                           environ, within=(lambda value: 0 < value <= 1, "in (0, 1]"))


def admission_margin_from_env(environ=os.environ) -> float:
    """``MOEBUS_ADMISSION_MARGIN`` (default 1; 0: every miss that beats the weakest resident): a
    number >= 0, else a ConfigError naming it, raised where a cache is built (a worker's start), not
    at import."""
    return number_from_env("MOEBUS_ADMISSION_MARGIN", "1", "a decayed use count", environ)


class LruPolicy:
    name = "lru"

    def __init__(self, num_keys: int = 0):
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def insert(self, key: int) -> None:
        self._order[key] = None

    def touch(self, key: int) -> None:
        self._order.move_to_end(key)

    def remove(self, key: int) -> None:
        self._order.pop(key, None)

    def victim(self, can_evict: Callable[[int], bool]) -> int | None:
        return next((k for k in self._order if can_evict(k)), None)

    def hottest_first(self) -> list[int]:
        return list(reversed(self._order))

    def observe(self, keys: np.ndarray) -> None:
        """One decode step's distinct keys (resident or not), before admissions are asked for."""
        for key in keys:
            if int(key) in self._order:
                self._order.move_to_end(int(key))

    def strongest_first(self, keys: np.ndarray) -> np.ndarray:
        """Missed keys in the order they should be admitted."""
        return np.asarray(keys)

    def weakest_first(self, limit: int) -> list[int]:
        """Up to ``limit`` resident keys, the first to evict first."""
        return [k for _, k in zip(range(limit), self._order)]

    def worth_admitting(self, key: int, victim: int | None) -> bool:
        return True

    def worth_keeping(self, key: int, victim: int | None) -> bool:
        return True


class FreqPolicy:
    name = "freq"

    def __init__(self, num_keys: int, decay: float | None = None, admission_margin: float | None = None):
        self.decay = cache_decay_from_env() if decay is None else decay
        self.admission_margin = admission_margin_from_env() if admission_margin is None else admission_margin
        self.score = np.zeros(num_keys, np.float64)  # decayed use count, for every key
        self._resident: dict[int, None] = {}  # insertion order breaks ties: oldest goes first

    def insert(self, key: int) -> None:
        self._resident[key] = None

    def touch(self, key: int) -> None:
        self.score[key] += 1.0

    def remove(self, key: int) -> None:
        self._resident.pop(key, None)

    def victim(self, can_evict: Callable[[int], bool]) -> int | None:
        best, best_score = None, np.inf
        for key in self._resident:
            if self.score[key] < best_score and can_evict(key):
                best, best_score = key, self.score[key]
        return best

    def hottest_first(self) -> list[int]:
        return sorted(self._resident, key=lambda k: -self.score[k])

    def observe(self, keys: np.ndarray) -> None:
        self.score *= self.decay
        self.score[np.asarray(keys, dtype=np.int64)] += 1.0

    def strongest_first(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.int64)
        return keys[np.argsort(-self.score[keys], kind="stable")]

    def weakest_first(self, limit: int) -> list[int]:
        if limit <= 0 or not self._resident:
            return []
        keys = np.fromiter(self._resident, dtype=np.int64, count=len(self._resident))
        order = np.argsort(self.score[keys], kind="stable")[:limit]  # ties: the oldest resident first
        return keys[order].tolist()

    def worth_admitting(self, key: int, victim: int | None) -> bool:
        """A missed key in place of ``victim`` (a copy over PCIe): only when it beats it by the margin."""
        return victim is None or self.score[key] > self.score[victim] + self.admission_margin

    def worth_keeping(self, key: int, victim: int | None) -> bool:
        """A resident key leaving in a shrink, in place of ``victim`` (a device copy)."""
        return victim is None or self.score[key] > self.score[victim]


def make_policy(name: str, num_keys: int):
    if name == "lru":
        return LruPolicy(num_keys)
    if name == "freq":
        return FreqPolicy(num_keys)
    raise ValueError(f"unknown cache policy {name!r} (choose from {', '.join(POLICIES)})")
