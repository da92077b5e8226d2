"""Issue 20 on a GPU: what one hand-back step costs the worker, by part. A VmmArena of 2960 segments
of 2 MiB (the 8 x 128 LLaVA's cache under an 8 GiB budget), slots of 9 MiB:

- shrink by 113 segments (one 225 MiB hand-back step) and grow back: one sync + one cuMemUnmap /
  one cuMemSetAccess for the range (now) vs a sync + unmap / access call per segment (before);
  then 32, 64 and 226 segments, and 10 MiB segments (one per slot) for the same MiB;
- cuMemGetInfo (each worker INFO reads it three times);
- max_free_bytes (every worker INFO) before (a sum over the kept head per segment) and now.
Prints one table; medians of 5."""
from __future__ import annotations

import statistics
import time

import numpy as np

from moebus.cuda.kernels import compat  # noqa: F401 - numpy shims before numba.cuda
from moebus.cuda.memory import vmm
from moebus.cuda.memory.arena import Arena, plan_segments
from moebus.cuda.memory.ledger import MIB
from numba import cuda

SLOT = 9 * MIB


class PerSegment(vmm.VmmArena):
    """The arena as it was: a sync, an unmap and a release per segment; access set per segment."""

    def _unmap_tail(self, offset, sizes):
        end = offset + sum(sizes)
        for size in reversed(sizes):
            end -= size
            cuda.synchronize()
            self._unmap(end, size)

    def _mapped_range(self, offset, size):
        for seg_offset, seg_size in self._segments_in(offset, size):
            vmm._check(self._cu.cuMemSetAccess(self._base + seg_offset, seg_size, [self._access], 1))


def timed(fn, repeats=5):
    out = []
    for _ in range(repeats):
        cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


def shrink_grow_ms(cls, segment_mib: int, count: int) -> tuple[float, float]:
    arena = cls(SLOT, np.uint8, plan_segments(5920 * MIB, segment_mib * MIB))
    arena.grow()
    shrinks, grows = [], []
    for _ in range(5):
        cuda.synchronize()
        t = time.perf_counter()
        arena.shrink(count)
        shrinks.append(time.perf_counter() - t)
        t = time.perf_counter()
        arena.grow()
        grows.append(time.perf_counter() - t)
    arena.close()
    return 1e3 * statistics.median(shrinks), 1e3 * statistics.median(grows)


class Bare(Arena):
    def _map(self, offset, size):
        pass

    def _unmap(self, offset, size):
        pass


def old_max_free(arena, min_slots=8):
    def kept_slots(n):
        return min(sum(arena.mapped[: max(len(arena.mapped) - n, 0)]) // arena.slot_bytes, arena.max_slots)
    count = 0
    while count < len(arena.mapped) and kept_slots(count + 1) >= min_slots:
        count += 1
    return sum(arena.mapped[len(arena.mapped) - count:])


def main() -> None:
    cuda.current_context()
    print(f"{'what':<58} {'before ms':>10} {'now ms':>8}")
    for segment_mib, count in ((2, 113), (2, 32), (2, 64), (2, 226), (10, 23)):
        old = shrink_grow_ms(PerSegment, segment_mib, count)
        new = shrink_grow_ms(vmm.VmmArena, segment_mib, count)
        what = f"{count} segments of {segment_mib} MiB ({count * segment_mib} MiB)"
        print(f"shrink {what:<51} {old[0]:>10.2f} {new[0]:>8.2f}")
        print(f"grow back {what:<48} {old[1]:>10.2f} {new[1]:>8.2f}")
    print(f"{'cuMemGetInfo':<58} {'':>10} {timed(vmm.device_memory_info, 200) :>8.3f}")
    bare = Bare(SLOT, np.uint8, plan_segments(5920 * MIB, 2 * MIB))
    bare.grow()
    assert old_max_free(bare) == bare.tail_to_release(None, 8)[1]
    print(f"{'max_free_bytes walk, 2960 segments (every worker INFO)':<58} {timed(lambda: old_max_free(bare)):>10.2f} "
          f"{timed(lambda: bare.tail_to_release(None, 8)):>8.3f}")


if __name__ == "__main__":
    main()
