"""The chain of a prefill's expert groups (expert_cache.py): each slot's fence, the point of the
compute stream after the last group of this pass that read it, so that a copy into the slot waits for
that point only; the victims a chained group takes (farthest next use first); and the runs of
consecutive slots and keys that one copy serves. Bookkeeping only: fences are whatever the copier's
``record_compute`` returns (an object with an ordering ``seq``)."""
from __future__ import annotations

import numpy as np

EMPTY = -1  # a slot's key when it holds none


def copy_runs(copies: list[tuple[int, int]], fences: list, contiguous: bool) -> list[list]:
    """(slot, key) copies and their fences as runs [first slot, first key, count, fence]: the earliest
    fences first (the copy stream runs in order: a late fence at its head would hold the rest), runs of
    consecutive slots and keys where ``contiguous`` (one copy each, waiting for the latest fence of its
    members)."""
    order = sorted(range(len(copies)), key=lambda i: (fences[i].seq, copies[i][0]))
    runs: list[list] = []
    for i in order:
        slot, key = copies[i]
        last = runs[-1] if runs else None
        if contiguous and last is not None and slot == last[0] + last[2] and key == last[1] + last[2]:
            last[2] += 1
            last[3] = fences[i] if fences[i].seq > last[3].seq else last[3]
        else:
            runs.append([slot, key, 1, fences[i]])
    return runs


class Chain:
    """A prefill's groups while their copies chain: each slot's fence (the compute stream's point
    after the last group that read it, or the chain's start for a slot no group of it read)."""

    def __init__(self, start, max_slots: int):
        self.start = start
        self.last = None  # the last release's fence
        self.fence = [None] * max_slots
        self.seq = np.full(max_slots, -1, np.int64)  # each slot's fence's order (-1: the chain's start)

    def fence_of(self, slot: int):
        return self.fence[slot] or self.start

    def released(self, fence, slots) -> None:
        self.last = fence
        for slot in slots:
            self.fence[slot] = fence
            self.seq[slot] = fence.seq

    def last_group(self) -> frozenset:
        """The slots of the group released last, which may still be read."""
        if self.last is None:
            return frozenset()
        return frozenset(np.flatnonzero(self.seq == self.last.seq).tolist())

    def victims(self, cache, count: int, row: int) -> list[int]:
        """``count`` resident keys, last to evict first, farthest next use first: slots released two
        or more groups ago (the policy's weakest, among equals the latest release: a key a pass has
        just inserted has not been touched yet, a key that hits every pass or that decode steps use
        has; so the same keys stay from pass to pass), then slots no group of this chain read (the
        layer farthest ahead of ``row`` first), then the last group's (their copies wait for its
        kernels)."""
        if count <= 0:
            return []
        used = np.flatnonzero(cache.slot_key[:cache.num_slots] != EMPTY)
        if cache.pinned:
            used = used[~np.isin(used, np.fromiter(cache.pinned, np.int64, len(cache.pinned)))]
        keys = cache.slot_key[used]
        seq = self.seq[used]
        last = self.last.seq if self.last is not None else -2
        rows = cache.placement.shape[0]
        ahead = (keys // cache.store.num_experts - row) % rows  # groups until this key's layer comes again
        tier = np.where(seq < 0, 1, np.where(seq == last, 2, 0))
        # tier 0: the policy's weakest first (decode's hot experts stay), among equals the latest release;
        # tier 1: farthest ahead first, within a layer the policy's weakest (a prompt chunk that spans
        # steps starts a chain each step: every slot is tier 1, and the layer it has just done holds
        # the decode steps' experts too); tier 2 (one release): any; ties: lower slot
        score = getattr(cache.policy, "score", None)
        weakness = score[keys] if score is not None else np.zeros(len(keys))
        first = np.where(tier == 0, weakness, np.where(tier == 1, -ahead, 0))
        then = np.where(tier == 0, -seq, np.where(tier == 1, weakness, 0))
        order = np.lexsort((used, then, first, tier))[:count]
        return keys[order].tolist()[::-1]
