"""Eviction policies of the expert cache. A policy orders resident keys; the cache asks it for a
victim among those it may evict (not pinned). Least-recently-used first; others plug in here."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class LruPolicy:
    def __init__(self):
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
