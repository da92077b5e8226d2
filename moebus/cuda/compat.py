"""The one place where kernels meet numba.cuda, so that the same kernel source runs on a GPU and in
numba's simulator (NUMBA_ENABLE_CUDASIM=1, how the tests run on CPU).

What differs between the two, and only that, lives here:
- bit reinterpretation (GPU: libdevice ``int_as_float`` / ``double_as_longlong``; the simulator has
  no libdevice, so numpy scalar views),
- warp reductions (GPU: ``shfl_xor_sync`` butterflies, every lane gets the same bits; the simulator
  has no shuffles, so the warp's 32 Python threads meet at a barrier of their own) and block
  reductions (warp partials through shared memory; in the simulator one shared buffer),
- block and grid sizes (the simulator runs every CUDA thread as a Python thread, so it gets small
  blocks and few blocks; kernels are written grid-stride so any size is correct),
- a lock around the simulator's first allocation of a static shared array (its own is racy).

**Rules for kernels that reduce.** Blocks are 1-D with a multiple of 32 threads. Every lane of a warp
calls each ``warp_*`` reduction the same number of times in the same order (no lane may return or
skip ahead before it); every thread of the block calls each ``block_*`` reduction likewise. A whole
block may return early. Loops over rows therefore run the same trip count in every warp and clamp
the row instead of skipping it, storing only when the row is real.
"""
from __future__ import annotations

import threading

import numpy as np

if not hasattr(np, "row_stack"):  # numpy 2.5 removed it; numba-cuda 0.30 still calls it when compiling
    np.row_stack = np.vstack

from numba import cuda, float32, float64, int32, int64, uint32, uint64  # noqa: E402,F401
from numba.cuda.core import config as _numba_config  # noqa: E402

SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)
WARP = 32
FULL_MASK = 0xFFFFFFFF
MAX_BLOCK_THREADS = 1024
MAX_WARPS = MAX_BLOCK_THREADS // 32
MAX_SUM_MANY = 16  # most values one warp_sum_many call reduces (simulator buffer width)
SIM_MAX_THREADS = 64  # simulator: Python threads per block
SIM_MAX_BLOCKS = 2  # simulator: blocks of a grid-stride kernel


def threads(preferred: int) -> int:
    """Threads per block for a grid-stride kernel (a multiple of 32)."""
    return min(preferred, SIM_MAX_THREADS) if SIMULATOR else preferred


def blocks(needed: int) -> int:
    """Blocks for a grid-stride kernel that would like ``needed`` of them."""
    needed = max(int(needed), 1)
    return min(needed, SIM_MAX_BLOCKS) if SIMULATOR else needed


def device(fn):
    """A device function, inlined on the GPU. In the simulator a function that does not touch
    ``cuda`` stays plain Python (the device-function wrapper costs a lock per call); one that does
    gets the wrapper, which swaps in the simulated ``cuda`` module while it runs."""
    if not SIMULATOR:
        return cuda.jit(device=True, forceinline=True)(fn)
    return cuda.jit(device=True)(fn) if "cuda" in fn.__code__.co_names else fn


def device_with_shared(fn):
    """A device function that declares shared memory (or calls one that does). On the GPU it is
    inlined at the numba IR level: compiled on its own, its shared array becomes a global that NVVM
    sees twice (and rejects) when two callers of one kernel both link the function."""
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, inline="always")(fn)


def data_ptr(array) -> int:
    """Address of the first element of a device (or, in the simulator, host) array."""
    iface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return int(iface["data"][0])


def is_contiguous(array) -> bool:
    if hasattr(array, "is_c_contiguous"):
        return bool(array.is_c_contiguous())
    return bool(array.flags.c_contiguous)


def _make_shared_allocation_thread_safe() -> None:
    """The simulator creates a static shared array on the first call from its source line, without
    a lock: two threads that get there together can end up with different arrays (and read each
    other's stale data). Same keying (caller's file and line), under a lock."""
    import sys

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


if SIMULATOR:
    _make_shared_allocation_thread_safe()

    # Plain Python: nothing here touches the fake `cuda` module, and skipping the device-function
    # wrapper keeps the simulator fast. Values arrive as numpy scalars.
    def bits_as_f32(bits):
        """float32 whose bit pattern is the low 32 bits of an integer."""
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    def f64_bits(value):
        """uint64 bit pattern of a float64 (a complex128 half read as 8 raw bytes)."""
        return np.float64(value).view(np.uint64)

    # Warp reductions: the 32 lanes of a warp (Python threads) meet at a barrier of their own,
    # cheaper than the simulator's block-wide syncthreads. Exchange buffers alternate between two
    # halves, so one barrier per call is enough: a lane can only come back to a half after every
    # lane passed the barrier in between, i.e. finished reading it.
    _warp_lock = threading.Lock()
    WARP_BARRIER_TIMEOUT_S = 60.0  # a lane that raised never arrives: fail instead of hanging

    class _LaneBarrier:
        """A barrier of the warp's lanes on one raw lock per lane: the last lane to arrive opens
        every other lane's gate. (threading.Barrier wakes its waiters one after another through a
        shared lock, which costs a thread switch interval each.)"""

        def __init__(self):
            self._arrived = 0
            self._mutex = threading.Lock()
            self._gates = [threading.Lock() for _ in range(WARP)]
            for gate in self._gates:
                gate.acquire()

        def wait(self, lane: int) -> None:
            with self._mutex:
                self._arrived += 1
                is_last = self._arrived == WARP
                if is_last:
                    self._arrived = 0
            if is_last:
                for other, gate in enumerate(self._gates):
                    if other != lane:
                        gate.release()
            elif not self._gates[lane].acquire(timeout=WARP_BARRIER_TIMEOUT_S):
                raise RuntimeError("a lane of this warp never reached the reduction")

    class _Warp:
        def __init__(self):
            self.barrier = _LaneBarrier()
            self.values = np.zeros((2, WARP, MAX_SUM_MANY), np.float32)
            self.indices = np.zeros((2, WARP), np.int64)

    def _exchange():
        """(this lane, its warp's state, the buffer half for this call)."""
        thread = threading.current_thread()
        warp = getattr(thread, "moebus_warp", None)
        if warp is None:
            with _warp_lock:  # one state per (block, warp): the block manager is per block
                warps = thread._manager.__dict__.setdefault("moebus_warps", {})
                warp = thread.moebus_warp = warps.setdefault(thread.thread_id // WARP, _Warp())
            thread.moebus_half = 0
        half = thread.moebus_half = 1 - thread.moebus_half
        return thread.thread_id % WARP, warp, half

    _PARTNERS = [np.arange(WARP) ^ offset for offset in (16, 8, 4, 2, 1)]

    def _butterfly_sum(values):
        """The GPU's xor-butterfly order, column by column: the same bits as shfl_xor_sync gives."""
        for partner in _PARTNERS:
            values = values + values[partner]
        return values[0]

    def warp_sum(value):
        """Sum over the 32 lanes of the warp; every lane gets the result."""
        lane, warp, half = _exchange()
        warp.values[half, lane, 0] = value
        warp.barrier.wait(lane)
        return _butterfly_sum(warp.values[half, :, 0])

    def warp_max(value):
        lane, warp, half = _exchange()
        warp.values[half, lane, 0] = value
        warp.barrier.wait(lane)
        return warp.values[half, :, 0].max()

    def _argmax_of(values, indices):
        best = values.max()
        return best, indices[values == best].min()

    def warp_argmax(value, index):
        """(max value, lowest index holding it) over the warp; every lane gets the result."""
        lane, warp, half = _exchange()
        warp.values[half, lane, 0] = value
        warp.indices[half, lane] = index
        warp.barrier.wait(lane)
        return _argmax_of(warp.values[half, :, 0], warp.indices[half])

    def warp_sum_many(values, count):
        """values[i] = warp sum of values[i] for i < count (<= MAX_SUM_MANY), with one barrier."""
        lane, warp, half = _exchange()
        for i in range(count):
            warp.values[half, lane, i] = values[i]
        warp.barrier.wait(lane)
        totals = _butterfly_sum(warp.values[half, :, :count])
        for i in range(count):
            values[i] = totals[i]

else:

    @device
    def bits_as_f32(bits):
        """float32 whose bit pattern is the low 32 bits of an integer."""
        return cuda.libdevice.int_as_float(int32(bits))

    @device
    def f64_bits(value):
        """uint64 bit pattern of a float64 (a complex128 half read as 8 raw bytes)."""
        return uint64(cuda.libdevice.double_as_longlong(value))

    @device
    def warp_sum(value):
        """Sum over the 32 lanes of the warp; every lane gets the same bits (xor butterfly)."""
        value += cuda.shfl_xor_sync(FULL_MASK, value, 16)
        value += cuda.shfl_xor_sync(FULL_MASK, value, 8)
        value += cuda.shfl_xor_sync(FULL_MASK, value, 4)
        value += cuda.shfl_xor_sync(FULL_MASK, value, 2)
        value += cuda.shfl_xor_sync(FULL_MASK, value, 1)
        return value

    @device
    def warp_max(value):
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, 16))
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, 8))
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, 4))
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, 2))
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, 1))
        return value

    @device
    def _argmax_step(value, index, offset):
        other = cuda.shfl_xor_sync(FULL_MASK, value, offset)
        other_index = cuda.shfl_xor_sync(FULL_MASK, index, offset)
        if other > value or (other == value and other_index < index):
            return other, other_index
        return value, index

    @device
    def warp_argmax(value, index):
        """(max value, lowest index holding it) over the warp; every lane gets the result."""
        index = int64(index)
        value, index = _argmax_step(value, index, 16)
        value, index = _argmax_step(value, index, 8)
        value, index = _argmax_step(value, index, 4)
        value, index = _argmax_step(value, index, 2)
        value, index = _argmax_step(value, index, 1)
        return value, index

    @device
    def warp_sum_many(values, count):
        """values[i] = warp sum of values[i] for i < count."""
        for i in range(count):
            values[i] = warp_sum(values[i])


# -- block reductions -----------------------------------------------------------------------------
# On the GPU: warp partials through shared memory, then every warp reduces the same partials in
# the same order, so every thread gets the same bits without a broadcast barrier. The simulator's
# versions do the same with one shared buffer and two barriers instead of six (its barriers are
# what costs); tests run the tree versions under the simulator too.

@device_with_shared
def tree_block_sum(value):
    partial = cuda.shared.array(MAX_WARPS, float32)
    tid = cuda.threadIdx.x
    value = warp_sum(value)
    cuda.syncthreads()  # the previous call's readers are done with `partial`
    if tid % WARP == 0:
        partial[tid // WARP] = value
    cuda.syncthreads()
    lane = tid % WARP
    value = partial[lane] if lane < cuda.blockDim.x // WARP else float32(0.0)
    return warp_sum(value)


@device_with_shared
def tree_block_max(value):
    partial = cuda.shared.array(MAX_WARPS, float32)
    tid = cuda.threadIdx.x
    value = warp_max(value)
    cuda.syncthreads()
    if tid % WARP == 0:
        partial[tid // WARP] = value
    cuda.syncthreads()
    lane = tid % WARP
    value = partial[lane] if lane < cuda.blockDim.x // WARP else partial[0]
    return warp_max(value)


@device_with_shared
def tree_block_argmax(value, index):
    """(max, lowest index holding it) over the block."""
    partial = cuda.shared.array(MAX_WARPS, float32)
    partial_index = cuda.shared.array(MAX_WARPS, int64)
    tid = cuda.threadIdx.x
    value, index = warp_argmax(value, index)
    cuda.syncthreads()
    if tid % WARP == 0:
        partial[tid // WARP] = value
        partial_index[tid // WARP] = index
    cuda.syncthreads()
    lane = tid % WARP
    if lane < cuda.blockDim.x // WARP:
        value, index = partial[lane], partial_index[lane]
    else:
        value, index = partial[0], partial_index[0]
    return warp_argmax(value, index)


if SIMULATOR:

    def _block_half():
        # same two-halves trick as the warps: one syncthreads per block reduction
        thread = threading.current_thread()
        half = thread.moebus_block_half = 1 - getattr(thread, "moebus_block_half", 0)
        return half

    @cuda.jit(device=True)
    def block_sum(value):
        buf = cuda.shared.array((2, MAX_BLOCK_THREADS), float32)
        half = _block_half()
        buf[half, cuda.threadIdx.x] = value
        cuda.syncthreads()
        return buf[half, : cuda.blockDim.x].sum(dtype=np.float32)

    @cuda.jit(device=True)
    def block_max(value):
        buf = cuda.shared.array((2, MAX_BLOCK_THREADS), float32)
        half = _block_half()
        buf[half, cuda.threadIdx.x] = value
        cuda.syncthreads()
        return buf[half, : cuda.blockDim.x].max()

    @cuda.jit(device=True)
    def block_argmax(value, index):
        vals = cuda.shared.array((2, MAX_BLOCK_THREADS), float32)
        idxs = cuda.shared.array((2, MAX_BLOCK_THREADS), int64)
        half = _block_half()
        vals[half, cuda.threadIdx.x] = value
        idxs[half, cuda.threadIdx.x] = index
        cuda.syncthreads()
        return _argmax_of(vals[half, : cuda.blockDim.x], idxs[half, : cuda.blockDim.x])

else:
    block_sum, block_max, block_argmax = tree_block_sum, tree_block_max, tree_block_argmax
