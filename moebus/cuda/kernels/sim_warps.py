"""The simulator's side of compat.py: warp reductions for Python threads, and a fix to the
simulator's shared arrays. Imported only when NUMBA_ENABLE_CUDASIM=1; kernels never import it.

A warp's 32 lanes (greenlets of one block: sim_blocks.py) meet at a barrier of their own, cheaper than
the block-wide syncthreads. Exchange buffers alternate between two halves, so one barrier per call is
enough: a lane can only come back to a half after every lane passed the barrier in between, i.e.
finished reading it. Sums follow the GPU's xor-butterfly order, so they have the GPU's bits."""
from __future__ import annotations

import sys
import threading

import numpy as np

from moebus.cuda.kernels import sim_blocks

WARP = 32
MAX_SUM_MANY = 16  # most values one warp_sum_many call reduces
_PARTNERS = [np.arange(WARP) ^ offset for offset in (16, 8, 4, 2, 1)]
_warp_lock = threading.Lock()


def make_shared_allocation_thread_safe() -> None:
    """The simulator creates a static shared array on the first call from its source line, without
    a lock: two threads that get there together can end up with different arrays (and read each
    other's stale data). Same keying (caller's file and line), under a lock."""
    from numba.cuda import types
    from numba.cuda.np.numpy_support import as_dtype
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    lock = threading.Lock()
    unsafe_array = FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory: no first-use race
            return unsafe_array(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            found = self._allocations.get(key)
            if found is None:
                dtype = as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
                found = self._allocations[key] = np.empty(shape, dtype)
        return found

    FakeCUDAShared.array = array


def bits_as_f32(bits):
    """float32 whose bit pattern is the low 32 bits of an integer."""
    return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)


def f32_bits(value):
    """The bit pattern of a float32, as an unsigned integer."""
    return int(np.float32(value).view(np.uint32))


class _LaneBarrier:
    """A barrier of the warp's 32 lanes (greenlets of one block, sim_blocks.py): the last lane to arrive opens
    it by moving its generation on; the others hand back to the block's manager until it has moved."""

    def __init__(self):
        self._arrived = 0
        self._generation = 0

    def wait(self, lane: int) -> None:
        self._arrived += 1
        if self._arrived == WARP:
            self._arrived = 0
            self._generation += 1
            return
        generation = self._generation
        sim_blocks.current().wait_until(lambda: self._generation != generation)


class _Warp:
    def __init__(self):
        self.barrier = _LaneBarrier()
        self.values = np.zeros((2, WARP, MAX_SUM_MANY), np.float32)
        self.indices = np.zeros((2, WARP), np.int64)


def _exchange():
    """(this lane, its warp's state, the buffer half for this call)."""
    thread = sim_blocks.current()
    warp = getattr(thread, "moebus_warp", None)
    if warp is None:
        with _warp_lock:  # one state per (block, warp): the simulator's block manager is per block
            warps = thread._manager.__dict__.setdefault("moebus_warps", {})
            warp = thread.moebus_warp = warps.setdefault(thread.thread_id // WARP, _Warp())
        thread.moebus_half = 0
    half = thread.moebus_half = 1 - thread.moebus_half
    return thread.thread_id % WARP, warp, half


def block_half() -> int:
    """The same two-halves trick for block reductions: one syncthreads each."""
    thread = sim_blocks.current()
    half = thread.moebus_block_half = 1 - getattr(thread, "moebus_block_half", 0)
    return half


def _butterfly_sum(values):
    """Column by column in the GPU's xor-butterfly order: the bits shfl_xor_sync gives."""
    for partner in _PARTNERS:
        values = values + values[partner]
    return values[0]


def argmax_of(values, indices):
    best = values.max()
    return best, indices[values == best].min()


def warp_sum(value):
    lane, warp, half = _exchange()
    warp.values[half, lane, 0] = value
    warp.barrier.wait(lane)
    return _butterfly_sum(warp.values[half, :, 0])


def warp_max(value):
    lane, warp, half = _exchange()
    warp.values[half, lane, 0] = value
    warp.barrier.wait(lane)
    return warp.values[half, :, 0].max()


def warp_argmax(value, index):
    lane, warp, half = _exchange()
    warp.values[half, lane, 0] = value
    warp.indices[half, lane] = index
    warp.barrier.wait(lane)
    return argmax_of(warp.values[half, :, 0], warp.indices[half])


def warp_sum_many(values, count):
    lane, warp, half = _exchange()
    for i in range(count):
        warp.values[half, lane, i] = values[i]
    warp.barrier.wait(lane)
    totals = _butterfly_sum(warp.values[half, :, :count])
    for i in range(count):
        values[i] = totals[i]
