"""The VRAM arena (cuda/memory/vmm.py) on a GPU: a shrink of several tail segments releases them with
one device sync and one unmap (the per-segment path too, which a driver refusing the range falls
back to), the driver shows the memory free at once, the head keeps its data, and a grow maps them
again with their access set in one call."""
import numpy as np
import pytest

from moebus.cuda.backends.graphs import graphs_available
from moebus.cuda.memory.ledger import MIB

pytestmark = pytest.mark.skipif(not graphs_available(), reason="VRAM segments need a GPU")


def per_segment_arena(slot_bytes, segments):
    """The fallback path as its own arena: one sync, unmap and access call per segment."""
    from numba import cuda

    from moebus.cuda.memory import vmm

    class PerSegment(vmm.VmmArena):
        def _unmap_tail(self, offset, sizes, after=None):
            after.synchronize() if after is not None else cuda.synchronize()
            super(vmm.VmmArena, self)._unmap_tail(offset, sizes, after)

        def _mapped_range(self, offset, size):
            for seg_offset, seg_size in self._segments_in(offset, size):
                vmm._check(self._cu.cuMemSetAccess(self._base + seg_offset, seg_size, [self._access], 1))

    return PerSegment(slot_bytes, np.uint8, segments)


@pytest.mark.parametrize("path", ["one call", "per segment"])
def test_a_tail_released_at_once_is_free_and_the_head_keeps_its_data(rng, path):
    from moebus.cuda.memory.vmm import VmmArena, device_memory_info

    segments = [2 * MIB] * 8  # 16 slots of 1 MiB
    arena = VmmArena(MIB, np.uint8, segments) if path == "one call" else per_segment_arena(MIB, segments)
    try:
        assert arena.grow() == 8 and arena.num_slots == 16
        data = rng.integers(0, 256, (16, MIB), dtype=np.uint8)
        for slot in range(16):
            arena.write(slot, data[slot])
        free_before = device_memory_info()[0]
        from numba import cuda

        written = cuda.event()
        written.record(0)  # the writes' end: what a shrink with a step launched beside it waits for
        assert arena.shrink(5, after=written) == 5 and arena.num_slots == 6 and arena.mapped_bytes == 6 * MIB
        assert device_memory_info()[0] - free_before >= 10 * MIB  # back with the driver at once
        assert all((arena.read(slot) == data[slot]).all() for slot in range(6))
        assert arena.grow(3) == 3 and arena.num_slots == 12
        for slot in range(6, 12):  # the mapped-again segments are readable and writable
            arena.write(slot, data[slot])
        assert all((arena.read(slot) == data[slot]).all() for slot in range(12))
        assert arena.shrink(1) == 1 and arena.num_slots == 10  # one segment alone
        assert all((arena.read(slot) == data[slot]).all() for slot in range(10))
    finally:
        arena.close()


@pytest.mark.parametrize("driver", [True, False])
def test_a_slot_moves_on_the_compute_stream(rng, driver):
    """StreamCopier.move: one driver copy (or numba's, its fallback) of a whole slot, ordered on the
    compute stream; the slots around it keep their bytes."""
    from types import SimpleNamespace

    from numba import cuda

    from moebus.cuda.memory.vmm import StreamCopier, VmmArena

    arena = VmmArena(MIB, np.uint8, [2 * MIB] * 4)
    try:
        arena.grow()
        copier = StreamCopier(arena, SimpleNamespace(stream=cuda.stream()))
        copier._driver_moves = driver
        data = rng.integers(0, 256, (8, MIB), dtype=np.uint8)
        for slot in range(8):
            arena.write(slot, data[slot])
        copier.move(6, 1)
        copier.move(7, 0)
        copier.compute_stream.synchronize()
        assert copier._driver_moves == driver  # the driver's copy was taken, not refused
        expected = [data[7], data[6]] + [data[slot] for slot in range(2, 8)]
        assert all((arena.read(slot) == expected[slot]).all() for slot in range(8))
        with pytest.raises(IndexError):
            arena.slot_address(8)
    finally:
        arena.close()
