"""The expert arena: one buffer indexed by slot (slot i at i * slot_bytes), so kernels take one
array and a slot table. The buffer's address range is reserved once at the start-up size and
backed by *segments* that can be handed back to the driver (shrink) and taken again (grow); a slot
is usable while it lies wholly inside the mapped segments. Subclasses back the segments with real
VRAM (vmm.py) or with host memory counted in an emulated GPU's ledger (HostArena)."""
from __future__ import annotations

import mmap

import numpy as np

from moebus.cuda.memory.ledger import MIB, EmulatedGpu, OutOfMemory

GRANULARITY = 2 * MIB  # CUDA's physical allocation granularity; the cpu arena keeps the same rule


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
        self.mapped: list[int] = []  # sizes of the mapped segments, in address order

    # -- subclass hooks ---------------------------------------------------------------------------
    def _map(self, offset: int, size: int) -> None:  # raise OutOfMemory when the memory is not there
        raise NotImplementedError

    def _unmap(self, offset: int, size: int) -> None:
        raise NotImplementedError

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        raise NotImplementedError

    # -- segments ---------------------------------------------------------------------------------
    @property
    def mapped_bytes(self) -> int:
        return sum(self.mapped)

    @property
    def num_slots(self) -> int:
        return min(self.mapped_bytes // self.slot_bytes, self.max_slots)

    def grow(self, num_segments: int | None = None) -> int:
        """Map up to ``num_segments`` more start-up segments (None: all); stops at the first that does
        not fit. Returns how many were mapped."""
        added = 0
        while len(self.mapped) < len(self.startup_segments) and (num_segments is None or added < num_segments):
            size = self.startup_segments[len(self.mapped)]
            try:
                self._map(self.mapped_bytes, size)
            except OutOfMemory:
                break
            self.mapped.append(size)
            added += 1
        return added

    def shrink(self, num_segments: int) -> int:
        """Unmap and release ``num_segments`` tail segments. The caller has emptied their slots."""
        removed = 0
        while self.mapped and removed < num_segments:
            size = self.mapped.pop()
            self._unmap(self.mapped_bytes, size)
            removed += 1
        return removed

    def slots_after_shrink(self, num_segments: int) -> int:
        kept = sum(self.mapped[: max(len(self.mapped) - num_segments, 0)])
        return min(kept // self.slot_bytes, self.max_slots)

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
        self.array[slot] = blob

    def read(self, slot: int) -> np.ndarray:
        return np.array(self.array[slot])
