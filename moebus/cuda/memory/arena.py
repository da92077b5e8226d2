"""The expert arena: one buffer indexed by slot (slot i at i * slot_bytes), so kernels take one
array and a slot table. The buffer's address range is reserved once at the start-up size and
backed by *segments* that can be handed back to the driver (shrink) and taken again (grow); a slot
is usable while it lies wholly inside the mapped segments. Subclasses back the segments with real
VRAM (vmm.py) or with host memory counted in an emulated GPU's ledger (HostArena).

A cache of 6 GiB in 2 MiB segments has ~3000 of them: every figure asked between two decode steps
(mapped bytes, how many tail segments a shrink takes) costs at most the segments it walks over,
never a sum over all of them per segment (which took ~50 ms there)."""
from __future__ import annotations

import mmap

import numpy as np

from moebus.cuda.memory.ledger import MIB, EmulatedGpu, OutOfMemory

GRANULARITY = 2 * MIB  # CUDA's physical allocation granularity; the cpu arena keeps the same rule
# settings segment_mib 0: a segment holds this many slots (in whole 2 MiB granules). A shrink unmaps and releases
# one physical allocation a segment, and their cost grows with their count, not their bytes: on the H200 a 64 MiB
# hand-back request of 2 MiB segments unmapped 30-32 of them in 1.3-2.7 ms and released them in 0.6 (thirtieth
# session), where one 16 MiB run of the twenty-fifth took 1.3-1.7 ms a request against 2.3-3.5. The default since
# the thirty-second session: two 9 MiB A3B slots a segment made each 64 MiB request of the cold image's hand-back
# 3.5-3.8 ms on the H100 (unmap 0.3-0.5, release 0.2), 2 MiB segments 4.9-6.7 (unmap 1.7-2.9, release 0.5-0.8).
SEGMENT_SLOTS = 2


def segment_bytes_for(segment_bytes: int, slot_bytes: int) -> int:
    """The arena's segment size: ``segment_bytes``, or where it is 0 SEGMENT_SLOTS slots rounded up to
    whole granules (18 MiB for bf16 A3B experts of 9 MiB; 2 MiB for the demo's of 192 KiB)."""
    return segment_bytes or -(-SEGMENT_SLOTS * slot_bytes // GRANULARITY) * GRANULARITY


def plan_segments(total_bytes: int, segment_bytes: int) -> list[int]:
    """Whole segments, then a short tail segment for the rest (in whole granules)."""
    full, rest = divmod(total_bytes, segment_bytes)
    tail = rest // GRANULARITY * GRANULARITY
    return [segment_bytes] * full + ([tail] if tail else [])


class Arena:
    def __init__(self, slot_bytes: int, dtype, startup_segments: list[int]):
        self.slot_bytes = slot_bytes
        self.dtype = np.dtype(dtype)
        if slot_bytes % self.dtype.itemsize:
            raise ValueError("slot_bytes must hold whole elements")
        self.startup_segments = list(startup_segments)
        self.reserved_bytes = sum(startup_segments)
        self.max_slots = self.reserved_bytes // slot_bytes
        self.mapped: list[int] = []  # sizes of the mapped segments, in address order (grow/shrink only)
        self._mapped_bytes = 0  # their sum
        self.last_release: dict = {}  # the last shrink's host time by part, where the arena times it (vmm.py)

    # -- subclass hooks ---------------------------------------------------------------------------
    def _map(self, offset: int, size: int) -> None:  # raise OutOfMemory when the memory is not there
        raise NotImplementedError

    def _unmap(self, offset: int, size: int) -> None:
        raise NotImplementedError

    def _unmap_tail(self, offset: int, sizes: list[int], after=None) -> None:
        """Unmap the tail segments of ``sizes`` (address order) that start at ``offset``, last first.
        ``after``: an event the device's work on them ends at (see ``shrink``)."""
        end = offset + sum(sizes)
        for size in reversed(sizes):
            end -= size
            self._unmap(end, size)

    def _mapped_range(self, offset: int, size: int) -> None:
        """After grow() mapped [offset, offset + size): one call for the whole range (vmm.py's access)."""

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        raise NotImplementedError

    # -- segments ---------------------------------------------------------------------------------
    @property
    def mapped_bytes(self) -> int:
        return self._mapped_bytes

    @property
    def num_slots(self) -> int:
        return min(self.mapped_bytes // self.slot_bytes, self.max_slots)

    def grow(self, num_segments: int | None = None) -> int:
        """Map up to ``num_segments`` more start-up segments (None: all); stops at the first that does
        not fit. Returns how many were mapped."""
        added, start = 0, self._mapped_bytes
        while len(self.mapped) < len(self.startup_segments) and (num_segments is None or added < num_segments):
            size = self.startup_segments[len(self.mapped)]
            try:
                self._map(self._mapped_bytes, size)
            except OutOfMemory:
                break
            self.mapped.append(size)
            self._mapped_bytes += size
            added += 1
        if added:
            self._mapped_range(start, self._mapped_bytes - start)
        return added

    def shrink(self, num_segments: int, after=None) -> int:
        """Unmap and release ``num_segments`` tail segments. The caller has emptied their slots.
        ``after``: an event (a device's) after the last work that touches them, where work enqueued
        since does not (a step launched beside the shrink, expert_cache.py): the unmap waits for it
        alone instead of for the whole device."""
        count = min(num_segments, len(self.mapped))
        if count <= 0:
            return 0
        tail = self.mapped[len(self.mapped) - count:]
        offset = self._mapped_bytes - sum(tail)
        self._unmap_tail(offset, tail, after)
        del self.mapped[len(self.mapped) - count:]
        self._mapped_bytes = offset
        return count

    def slots_after_shrink(self, num_segments: int) -> int:
        kept = self._mapped_bytes - sum(self.mapped[len(self.mapped) - min(num_segments, len(self.mapped)):])
        return min(kept // self.slot_bytes, self.max_slots)

    def tail_to_release(self, wanted_bytes: int | None, min_slots: int) -> tuple[int, int]:
        """(segments, bytes): the fewest tail segments that free at least ``wanted_bytes`` (None: as
        many as may go), keeping ``min_slots`` slots mapped. Walks only the segments it takes (or,
        for None, those it keeps)."""
        if wanted_bytes is None:
            return self._all_but_floor(min_slots)
        count, freed = 0, 0
        while count < len(self.mapped) and (wanted_bytes is None or freed < wanted_bytes):
            size = self.mapped[len(self.mapped) - 1 - count]
            kept = self._mapped_bytes - freed - size
            if min(kept // self.slot_bytes, self.max_slots) < min_slots:
                break
            count, freed = count + 1, freed + size
        return count, freed

    def _all_but_floor(self, min_slots: int) -> tuple[int, int]:
        """Every tail segment above the shortest head that still holds ``min_slots`` slots."""
        kept, head = 0, 0
        while head < len(self.mapped) and min(kept // self.slot_bytes, self.max_slots) < min_slots:
            kept, head = kept + self.mapped[head], head + 1
        if min(kept // self.slot_bytes, self.max_slots) < min_slots:
            return 0, 0  # even every mapped segment holds fewer: none may go
        return len(self.mapped) - head, self._mapped_bytes - kept

    def close(self) -> None:
        self.shrink(len(self.mapped))


class HostArena(Arena):
    """The cpu device's arena: an anonymous memory map of the reserved size; a segment's pages are
    given back to the OS (MADV_DONTNEED) and to the emulated GPU's ledger when it is unmapped."""

    def __init__(self, slot_bytes: int, dtype, startup_segments: list[int], gpu: EmulatedGpu | None = None,
                 tag: str = "expert-cache"):
        super().__init__(slot_bytes, dtype, startup_segments)
        self.gpu = gpu
        self.tag = tag
        self._map_obj = mmap.mmap(-1, max(self.reserved_bytes, mmap.PAGESIZE))
        flat = np.frombuffer(self._map_obj, dtype=self.dtype, count=self.max_slots * slot_bytes // self.dtype.itemsize)
        self.array = flat.reshape(self.max_slots, slot_bytes // self.dtype.itemsize)

    def _map(self, offset: int, size: int) -> None:
        if self.gpu is not None:
            self.gpu.allocate(size, self.tag)

    def _unmap(self, offset: int, size: int) -> None:
        self._map_obj.madvise(mmap.MADV_DONTNEED, offset, size)
        if self.gpu is not None:
            self.gpu.release(size, self.tag)

    def memory_info(self) -> tuple[int, int]:
        if self.gpu is None:
            return 0, 0
        return self.gpu.memory_info()

    def write(self, slot: int, blob: np.ndarray, stream=None) -> None:
        """One blob into ``slot``, or (n, elems) blobs into slots slot..slot+n-1."""
        if blob.ndim == 2:
            self.array[slot:slot + blob.shape[0]] = blob
        else:
            self.array[slot] = blob

    def read(self, slot: int) -> np.ndarray:
        return np.array(self.array[slot])
