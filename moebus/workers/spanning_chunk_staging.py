"""A spanning chunk's missed experts copied into slots of its own loan, not admitted into the cache
(issue 20; ``MOEBUS_CHUNK_STAGING_SLOTS``, 0: off). Thirteenth session's call 2 (H200, 8 x 128 A3B
LLaVA under 8 GiB, 2 text streams): while the image's chunks ran, the text streams' decode rows
missed ~32 experts a step against ~15 before (~390 MiB a step over PCIe against ~190), which made a
median chunk step ~12 ms (2x the streams' 5.6 ms gap): each chunk copies in ~300 experts through
``ExpertCache.acquire``, which evicts that many of the cache's (its policy's weakest, but a cache
holding 2/3 of the experts holds little that decode never reads) and ranks the chunk's experts as
any other.

Here the chunk's loan (prompt_loan's scratch, held across its steps, chunk_advance.hold_loan) is
``STAGING_SLOTS`` slots longer: a group's experts resident in the cache are read where they are
(its hits: not touched, so the cache's policy sees decode alone), its misses are copied into those
staging slots, each copy after the compute stream's work so far (a fence: the earlier groups that
read a staging slot are done before it is overwritten), and nothing of the cache changes: no
eviction, no admission, no wait for the decode rows' admissions in flight (an expert whose
admission has not landed is a miss here). A group has at most ``STAGING_SLOTS`` misses
(chunk_advance.group_end). The experts' bytes are the same wherever they are read from, so the
chunk's tokens, logits and keys and values do not change (tests/workers/test_spanning_chunk.py)."""
from __future__ import annotations

import os

import numpy as np

STAGING_SLOTS = int(os.environ.get("MOEBUS_CHUNK_STAGING_SLOTS", "0"))  # (0 off: call A measures 16)


class StagedExperts:
    """The expert cache as a spanning chunk's groups read it (``acquire``, ``wait``, ``release``,
    ``array``, ``store``, ``num_slots``, ``is_hit``), its misses in the staging slots [lo, hi)."""

    def __init__(self, cache, lo: int, hi: int):
        assert hi > lo
        self.cache, self.lo, self.hi = cache, lo, hi
        self.store = cache.store
        self.copies = 0  # experts copied into the staging slots
        self.pinned = set()  # (HostTiles and the stage read no pins: kept for the cache's interface)

    @property
    def array(self):
        return self.cache.array

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    @property
    def max_misses(self) -> int:
        return self.hi - self.lo

    def slot_of(self, key: int):
        """The cache's slot of ``key`` where a kernel may read it now; None: a miss here (not
        resident, its admission's copy not landed, or in a prefetch bank, which decode's graphs refill)."""
        cache = self.cache
        slot = cache.key_slot.get(key)
        if slot is None or key in cache.pending or slot < cache.num_reserved:
            return None
        return slot

    def is_hit(self, key: int) -> bool:
        return self.slot_of(key) is not None

    def acquire(self, layer: int, expert_ids) -> tuple[np.ndarray, np.ndarray]:
        """(slots, ready) as ``ExpertCache.acquire``'s: the hits' cache slots (ready), the misses'
        staging slots (their copies enqueued; ``wait`` before reading them)."""
        from moebus.workers.expert_cache import CacheTooSmall

        cache = self.cache
        keys = [self.store.key(layer, int(e)) for e in expert_ids]
        slots = np.empty(len(keys), np.int32)
        ready = np.ones(len(keys), bool)
        missed = []
        for i, key in enumerate(keys):
            slot = self.slot_of(key)
            if slot is None:
                missed.append(i)
            else:
                slots[i] = slot
        if len(missed) > self.max_misses:
            raise CacheTooSmall(f"{len(missed)} misses in one group, {self.max_misses} staging slots")
        if not missed:
            return slots, ready
        copier = cache.copier
        fence = copier.record_compute() if getattr(copier, "fences", False) else None
        done = True
        for j, i in enumerate(missed):
            slots[i] = self.lo + j
            done &= copier.copy(self.lo + j, self.store.blob(keys[i]), fence)
        ready[missed] = done
        self.copies += len(missed)
        cache.misses += len(missed)
        cache.h2d_bytes += len(missed) * self.store.blob_bytes
        return slots, ready

    def wait(self) -> None:
        self.cache.copier.wait()

    def release(self) -> None:
        self.cache.release()
