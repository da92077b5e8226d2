"""The elastic expert cache: pure bookkeeping over an arena. Tables map (layer, expert) keys to
slots and back; a policy keeps recency; the experts of the group being computed are pinned (a
pinned expert is never evicted or moved). Misses are copied from the host store into free or
evicted slots by a copier (synchronous on cpu, a copy stream on cuda).

VRAM requests resize the arena by whole segments: ``resize(r)`` empties and releases tail segments
until at least r MiB are free on the device (at least one segment when anything is missing), or
grows again while r allows; ``resize(None)`` (bare) maps every start-up segment again."""
from __future__ import annotations

import numpy as np

from moebus.cuda.ledger import MIB
from moebus.workers.eviction import LruPolicy

EMPTY = -1


class CacheTooSmall(RuntimeError):
    pass


class SyncCopier:
    """Copies on the calling thread (the cpu device): every copy is complete when it returns."""

    def __init__(self, arena):
        self.arena = arena

    def copy(self, slot: int, blob) -> bool:
        self.arena.write(slot, blob)
        return True

    def wait(self) -> None:
        pass


class ExpertCache:
    def __init__(self, store, arena, copier=None, policy=None, startup_reserve_mib: float = 0.0,
                 min_slots: int = 1):
        self.store = store
        self.arena = arena
        self.copier = copier or SyncCopier(arena)
        self.policy = policy or LruPolicy()
        self.min_slots = min_slots
        self.startup_reserve_mib = self.reserve_mib = startup_reserve_mib
        self.slot_key = np.full(arena.max_slots, EMPTY, dtype=np.int64)
        self.key_slot: dict[int, int] = {}
        self.free: list[int] = list(range(arena.num_slots))[::-1]
        self.pinned: set[int] = set()
        self.loaned_from: int | None = None  # slots from here on are lent out as step scratch
        self.hits = self.misses = self.h2d_bytes = 0
        self.key_hits: dict[int, int] = {}  # hits of resident keys since their admission (the dashboard's map)

    @property
    def array(self):
        """The arena as the kernels see it: (max_slots, blob elements)."""
        return self.arena.array

    @property
    def num_slots(self) -> int:
        """Slots in service: mapped, and not lent to a prefill."""
        mapped = self.arena.num_slots
        return mapped if self.loaned_from is None else min(mapped, self.loaned_from)

    # -- the prompt-path loan ---------------------------------------------------------------------

    def lend(self, num_bytes: int) -> tuple[int, int]:
        """Lend tail slots to a long prefill as scratch; returns the lent slot range [lo, hi).
        At least ``min_slots`` stay in service. The loan is computed against the cache as it is
        now, so it never covers memory that a shrink handed back."""
        assert self.loaned_from is None and not self.pinned
        wanted = -(-num_bytes // self.arena.slot_bytes)
        count = max(0, min(wanted, self.num_slots - self.min_slots))
        hi = self.num_slots
        lo = hi - count
        self._take_out_of_service(lo)
        self.loaned_from = lo
        return lo, hi

    def lent_bytes(self, lo: int, hi: int):
        """The lent slots [lo, hi) as one 1-D uint8 array (the memory a prefill's scratch uses)."""
        return self.arena.array[lo:hi].view(np.uint8).reshape(-1)

    def end_loan(self) -> None:
        if self.loaned_from is not None:
            lo, self.loaned_from = self.loaned_from, None
            self._put_in_service(lo)

    # -- the forward pass -------------------------------------------------------------------------

    def acquire(self, layer: int, expert_ids) -> tuple[np.ndarray, np.ndarray]:
        """Pin the experts of one group and return (slots, ready). Misses are being copied in;
        call wait() before reading a slot that is not ready. Replaces the previous group's pins."""
        keys = [self.store.key(layer, e) for e in expert_ids]
        if len(keys) > self.num_slots:
            raise CacheTooSmall(f"{len(keys)} experts in one group, {self.num_slots} slots")
        self.pinned = set()
        slots = np.empty(len(keys), dtype=np.int32)
        ready = np.ones(len(keys), dtype=bool)
        for i, key in enumerate(keys):  # hits first, so that a miss never evicts one of them
            slot = self.key_slot.get(key)
            if slot is not None:
                slots[i] = slot
                self.pinned.add(slot)
                self.policy.touch(key)
                self.hits += 1
                self.key_hits[key] = self.key_hits.get(key, 0) + 1
        for i, key in enumerate(keys):
            if key in self.key_slot:
                continue
            slot = self._take_slot()
            self._assign(slot, key)
            ready[i] = self.copier.copy(slot, self.store.blob(key))
            slots[i] = slot
            self.pinned.add(slot)
            self.misses += 1
            self.h2d_bytes += self.store.blob_bytes
        return slots, ready

    def wait(self) -> None:
        self.copier.wait()

    def release(self) -> None:
        self.pinned = set()

    def _take_slot(self) -> int:
        if self.free:
            return self.free.pop()
        key = self.policy.victim(lambda k: self.key_slot[k] not in self.pinned)
        assert key is not None, "every slot pinned: groups are capped at num_slots"
        slot = self.key_slot[key]
        self._evict(slot)
        return slot

    def _assign(self, slot: int, key: int) -> None:
        self.slot_key[slot] = key
        self.key_slot[key] = slot
        self.policy.insert(key)

    def _evict(self, slot: int) -> None:
        key = int(self.slot_key[slot])
        self.slot_key[slot] = EMPTY
        del self.key_slot[key]
        self.key_hits.pop(key, None)  # an expert admitted again counts its hits anew
        self.policy.remove(key)

    # -- VRAM requests ----------------------------------------------------------------------------

    def resize(self, reserve_mib: float | None, query: bool = False) -> dict:
        """Apply a reserve (MiB that must be free on the device) or, with None, go back to the full
        start-up size. Runs between steps: nothing is pinned."""
        assert not self.pinned and self.loaned_from is None, "resize while a step holds experts or a loan"
        if query:
            return self.report()
        if reserve_mib is None:
            self.reserve_mib = self.startup_reserve_mib
            self._grow(None)
            return self.report()
        self.reserve_mib = float(reserve_mib)
        free, _ = self.arena.memory_info()
        missing = int(self.reserve_mib * MIB) - free
        if missing > 0:
            self._shrink_for(missing)
        else:
            self._grow_within(-missing)
        return self.report()

    def _shrink_for(self, missing_bytes: int) -> None:
        count, freed = 0, 0
        mapped = self.arena.mapped
        while freed < missing_bytes and count < len(mapped):
            if self.arena.slots_after_shrink(count + 1) < self.min_slots:
                break  # the model must still run: keep enough slots for one expert group
            count += 1
            freed += mapped[-count]
        self._take_out_of_service(self.arena.slots_after_shrink(count))
        self.arena.shrink(count)

    def _grow_within(self, spare_bytes: int) -> None:
        count = 0
        pending = self.arena.startup_segments[len(self.arena.mapped):]
        while count < len(pending) and pending[count] <= spare_bytes:
            spare_bytes -= pending[count]
            count += 1
        self._grow(count)

    def _grow(self, count: int | None) -> None:
        before = self.num_slots
        self.arena.grow(count)
        self._put_in_service(before)

    def _take_out_of_service(self, first: int) -> None:
        """Slots from ``first`` up to num_slots leave service (shrink, loan): evict, unlist."""
        for slot in range(first, self.num_slots):
            if self.slot_key[slot] != EMPTY:
                self._evict(slot)
        self.free = [s for s in self.free if s < first]

    def _put_in_service(self, first: int) -> None:
        """Slots from ``first`` up to num_slots are empty and usable again (grow, end of a loan)."""
        self.free = list(range(self.num_slots - 1, first - 1, -1)) + self.free

    def report(self) -> dict:
        free, _ = self.arena.memory_info()
        return {"reserve_mib": self.reserve_mib, "free_mib": round(free / MIB, 1),
                "expert_slots": self.num_slots, "expert_cache_mib": round(self.arena.mapped_bytes / MIB, 1)}

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "h2d_bytes": self.h2d_bytes,
                "resident_experts": len(self.key_slot), **self.report()}

    def residency(self) -> dict:
        """Which (layer, expert) are resident and their hits since admission, compact enough for
        every INFO reply: ``keys`` are the store's keys (row * num_experts + expert, where row
        indexes ``layers``), ``hits`` the hit count of each, in the same order."""
        keys = sorted(self.key_slot)
        return {"layers": list(getattr(self.store, "layers", [])), "num_experts": int(self.store.num_experts),
                "keys": keys, "hits": [self.key_hits.get(k, 0) for k in keys]}
