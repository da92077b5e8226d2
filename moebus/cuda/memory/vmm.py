"""Arenas in VRAM. ``VmmArena`` reserves the start-up address range once (cuMemAddressReserve) and
backs it with physical segments (cuMemCreate + cuMemMap + cuMemSetAccess); shrinking unmaps and
*releases* tail segments, so the memory is back with the driver at once (no deferred free as with
numba's allocator), and another process can allocate it. ``DeviceArena`` is one fixed allocation
(no elasticity; also what runs under numba's simulator). ``StreamCopier`` copies misses from the
pinned host store on a copy stream that overlaps the compute stream."""
from __future__ import annotations

import ctypes
import time

import numpy as np

from moebus.cuda.kernels import compat  # noqa: F401 - numpy shims before numba.cuda
from moebus.cuda.memory.arena import Arena
from moebus.cuda.memory.ledger import OutOfMemory
from numba import cuda


class VmmError(RuntimeError):
    pass


def _check(result):
    from cuda.bindings import driver as cu

    err, *values = result if isinstance(result, tuple) else (result,)
    if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
        raise OutOfMemory("cuMemCreate: out of device memory")
    if err != cu.CUresult.CUDA_SUCCESS:
        raise VmmError(f"CUDA driver error {err}")
    return values[0] if len(values) == 1 else values


def _stream_handle(stream) -> int:
    """A numba stream's driver handle (0: the default stream)."""
    return 0 if isinstance(stream, int) else int(stream.handle)


def _wrap(ptr: int, size: int, shape, dtype) -> "cuda.devicearray.DeviceNDArray":
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.cudadrv.driver import MemoryPointer

    dtype = np.dtype(dtype)
    mem = MemoryPointer(cuda.current_context(), ctypes.c_void_p(ptr), size)
    strides = (shape[1] * dtype.itemsize, dtype.itemsize)
    return DeviceNDArray(shape, strides, dtype, gpu_data=mem)


def device_memory_info() -> tuple[int, int]:
    """(free, total) bytes of this process's GPU (cuMemGetInfo)."""
    info = cuda.current_context().get_memory_info()
    return int(info[0]), int(info[1])


class _DeviceSlots:
    """What both device arenas do with their ``array`` of (max_slots, elems) slots: slot i at
    ``_base_address() + i * slot_bytes``."""

    def slot_address(self, slot: int) -> int:
        """The device address where ``slot`` starts."""
        if not 0 <= slot < self.max_slots:
            raise IndexError(f"slot {slot} outside [0, {self.max_slots})")
        return self._base_address() + slot * self.slot_bytes

    def write(self, slot: int, blob, stream=0) -> None:
        """One blob into ``slot``, or (n, elems) blobs into slots slot..slot+n-1."""
        target = self.array[slot:slot + blob.shape[0]] if blob.ndim == 2 else self.array[slot]
        target.copy_to_device(blob, stream=stream)

    def read(self, slot: int) -> np.ndarray:
        return self.array[slot].copy_to_host()

    def memory_info(self) -> tuple[int, int]:
        return device_memory_info()


class VmmArena(_DeviceSlots, Arena):
    def __init__(self, slot_bytes: int, dtype, startup_segments: list[int]):
        from cuda.bindings import driver as cu

        super().__init__(slot_bytes, dtype, startup_segments)
        self._cu = cu
        ctx = cuda.current_context()  # numba's primary context is current from here on
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ctx.device.id
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = prop.location.type
        access.location.id = prop.location.id
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        granule = int(_check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        if any(s % granule for s in startup_segments):
            raise ValueError(f"segments must be multiples of the {granule}-byte granularity")
        self._base = int(_check(cu.cuMemAddressReserve(self.reserved_bytes, 0, 0, 0)))
        self._handles: list = []
        elems = slot_bytes // self.dtype.itemsize
        self.array = _wrap(self._base, self.max_slots * slot_bytes, (self.max_slots, elems), self.dtype)
        self._ctx = ctx

    def _map(self, offset: int, size: int) -> None:
        """Create and map one segment; grow() then sets the access of all it mapped at once."""
        cu = self._cu
        handle = _check(cu.cuMemCreate(size, self._prop, 0))
        try:
            _check(cu.cuMemMap(self._base + offset, size, 0, handle, 0))
        except Exception:
            cu.cuMemRelease(handle)
            raise
        self._handles.append(handle)

    def _mapped_range(self, offset: int, size: int) -> None:
        cu = self._cu
        try:  # one call over every segment grow() mapped (~900 at 2 MiB for a 1.8 GB regrow)
            _check(cu.cuMemSetAccess(self._base + offset, size, [self._access], 1))
            return
        except VmmError:  # a driver that wants one call per mapping
            pass
        for seg_offset, seg_size in self._segments_in(offset, size):
            _check(cu.cuMemSetAccess(self._base + seg_offset, seg_size, [self._access], 1))

    def _segments_in(self, offset: int, size: int) -> list[tuple[int, int]]:
        """(offset, size) of the mapped segments that tile [offset, offset + size)."""
        out, at = [], 0
        for seg in self.mapped:
            if offset <= at < offset + size:
                out.append((at, seg))
            at += seg
        return out

    def _unmap(self, offset: int, size: int) -> None:
        """One segment, the last mapped (the caller has synchronised)."""
        _check(self._cu.cuMemUnmap(self._base + offset, size))
        _check(self._cu.cuMemRelease(self._handles.pop()))

    def _unmap_tail(self, offset: int, sizes: list[int], after=None) -> None:
        """One device sync and one cuMemUnmap for the whole tail (a hand-back step releases ~110
        segments of 2 MiB, which took a sync and an unmap each), then each segment's handle released.
        ``after``: the event after the last work on the segments, waited for in place of the device
        (a step launched since still runs: it reads none of them). cuMemUnmap and cuMemRelease do not
        synchronize in all cases (PyTorch's expandable segments wait for their stream before unmapping
        for that reason), so the wait is ours either way."""
        started = time.perf_counter()
        if after is not None:
            after.synchronize()
        else:
            cuda.synchronize()  # no kernel or copy may still touch the segments
        synced = time.perf_counter()
        try:
            _check(self._cu.cuMemUnmap(self._base + offset, sum(sizes)))
        except VmmError:  # a driver that wants one call per mapping
            super()._unmap_tail(offset, sizes, after)
            return
        unmapped = time.perf_counter()
        for _ in sizes:
            _check(self._cu.cuMemRelease(self._handles.pop()))
        self.last_release = {"sync_s": synced - started, "unmap_s": unmapped - synced,
                             "release_s": time.perf_counter() - unmapped}

    def _base_address(self) -> int:
        return self._base

    def close(self) -> None:
        super().close()
        _check(self._cu.cuMemAddressFree(self._base, self.reserved_bytes))


class DeviceArena(_DeviceSlots, Arena):
    """One allocation of the start-up size: segments are bookkeeping only."""

    def __init__(self, slot_bytes: int, dtype, startup_segments: list[int]):
        super().__init__(slot_bytes, dtype, startup_segments)
        self.array = cuda.device_array((self.max_slots, slot_bytes // self.dtype.itemsize), dtype=self.dtype)

    def _map(self, offset: int, size: int) -> None:
        pass

    def _unmap(self, offset: int, size: int) -> None:
        pass

    def _base_address(self) -> int:
        return int(self.array.device_ctypes_pointer.value)


def make_device_arena(slot_bytes: int, dtype, segments: list[int], elastic: bool) -> Arena:
    if elastic and not compat.SIMULATOR:
        return VmmArena(slot_bytes, dtype, segments)
    return DeviceArena(slot_bytes, dtype, segments)


class Fence:
    """A point of the compute stream: its event and its order among the points a copier handed out
    (a later point implies every earlier one, the stream runs in order)."""

    __slots__ = ("seq", "event")

    def __init__(self, seq: int, event):
        self.seq, self.event = seq, event


class StreamCopier:
    """Host -> slot copies on their own stream. A copy given no ``after``: before the first such copy
    after a wait(), the copy stream waits for the compute stream's work so far, so a slot is never
    overwritten while a kernel that was enqueued earlier still reads it. A copy given ``after`` (a
    Fence from ``record_compute``) waits for that point of the compute stream only: the caller vouches
    that no kernel enqueued since reads the slot (the expert cache's per-slot fences within a prefill,
    expert_cache.py), so a layer's copies run beside the layers before. wait() makes the compute stream
    wait for the copies.

    A copy is one ``cuMemcpyHtoDAsync`` from the pinned store to the slot's address (numba's
    slice-and-copy costs tens of microseconds of host time a call, ~1,500 calls a 2048-token prefill
    at a 25% cache); a run of consecutive blobs into consecutive slots is one copy. numba's copy is
    the fallback (the simulator, or bindings that refuse the call)."""

    fences = True  # per-slot fences (record_compute / copy(after=...)): the expert cache chains on them

    def __init__(self, arena: Arena, backend):
        self.arena = arena
        self.compute_stream = getattr(backend, "stream", 0)
        self.stream = cuda.stream()
        self._fenced = False
        self._done = None  # recorded after the last batch of copies (mark)
        self._driver_moves = True  # move(): one cuMemcpyDtoDAsync (False after the bindings refused one)
        self.driver_copies = not compat.SIMULATOR  # copy(): one cuMemcpyHtoDAsync (False: numba's copy)
        self._seq = 0  # compute-stream points handed out (record_compute)
        self._waited = 0  # the copy stream waits for every point up to this one

    def record_compute(self) -> Fence:
        """The compute stream's current end, as a Fence for later copies."""
        event = cuda.event()
        event.record(self.compute_stream)
        self._seq += 1
        return Fence(self._seq, event)

    def record_copy(self):
        """An event at the copy stream's current end (timelines)."""
        event = cuda.event()
        event.record(self.stream)
        return event

    def copy(self, slot: int, blob, after: Fence | None = None) -> bool:
        """Enqueue ``blob`` (one blob, or (n, elems) blobs for slots slot..slot+n-1) into its slot(s);
        returns False: the copy completes on the copy stream (wait() orders the compute after it)."""
        if after is not None:
            if after.seq > self._waited:
                after.event.wait(self.stream)
                self._waited = after.seq
        elif not self._fenced:
            fence = self.record_compute()
            fence.event.wait(self.stream)
            self._waited = fence.seq  # every point handed out so far is behind this one
            self._fenced = True
        self._write(slot, blob)
        return False

    def _write(self, slot: int, blob) -> None:
        arena = self.arena
        if self.driver_copies and hasattr(arena, "slot_address") and blob.flags.c_contiguous:
            count = blob.shape[0] if blob.ndim == 2 else 1
            try:
                from cuda.bindings import driver as cu

                arena.slot_address(slot + count - 1)  # raises past the arena's end
                _check(cu.cuMemcpyHtoDAsync(arena.slot_address(slot), blob.ctypes.data, blob.nbytes,
                                            _stream_handle(self.stream)))
                return
            except (VmmError, TypeError, ImportError):  # bindings that want other types: numba's copy from now on
                self.driver_copies = False
        arena.write(slot, blob, stream=self.stream)

    def wait(self) -> None:
        done = cuda.event()
        done.record(self.stream)
        done.wait(self.compute_stream)
        self._fenced = False

    def mark(self) -> None:
        """Remember the copies enqueued so far, for is_done()."""
        self._done = cuda.event()
        self._done.record(self.stream)

    def is_done(self) -> bool:
        """True once every copy enqueued before the last mark() has finished (never blocks)."""
        return self._done is None or self._done.query()

    def sync(self) -> None:
        self.stream.synchronize()

    def move(self, src: int, dst: int) -> None:
        """Slot to slot on the device, on the compute stream: after the kernels enqueued so far, before
        the next (a shrink's sync then orders it before the unmap). A VmmArena's slots are copied by
        one driver call: numba's slice-and-copy cost ~0.4 ms of host time per 9 MiB slot on the H200
        (25 of them were two thirds of a hand-back step)."""
        arena = self.arena
        if isinstance(arena, VmmArena) and self._driver_moves:
            try:
                _check(arena._cu.cuMemcpyDtoDAsync(arena.slot_address(dst), arena.slot_address(src),
                                                   arena.slot_bytes, _stream_handle(self.compute_stream)))
                return
            except (VmmError, TypeError):  # bindings that want other handle types: numba's copy from now on
                self._driver_moves = False
        arena.array[dst].copy_to_device(arena.array[src], stream=self.compute_stream)
