"""The one place where kernels meet numba.cuda, so that the same kernel source runs on a GPU and in
numba's simulator (NUMBA_ENABLE_CUDASIM=1, how the tests run on CPU).

What differs between the two, and only that, lives here:
- bit reinterpretation (GPU: libdevice ``int_as_float``; the simulator has no libdevice, so numpy
  scalar views),
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

import functools
import logging
import os
import tempfile

import numpy as np

if not hasattr(np, "row_stack"):  # numpy 2.5 removed it; numba-cuda 0.30 still calls it when compiling
    np.row_stack = np.vstack

from numba import cuda, float32, int32, int64, uint16, uint32, uint64  # noqa: E402,F401
from numba.cuda.core import config as _numba_config  # noqa: E402

SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)
if not SIMULATOR and not _numba_config.CACHE_DIR:
    # a process started without NUMBA_CACHE_DIR (bench, generate --local) still caches in a directory
    # of this source tree's fingerprint, never in numba's default beside the sources, where an edit to
    # a device function in this file would not invalidate the kernels that call it
    from moebus.cuda.kernels.kernel_cache import LOCAL_ROLE, role_cache_dir  # noqa: E402

    _numba_config.CACHE_DIR = str(role_cache_dir(None, LOCAL_ROLE))
if not SIMULATOR:  # a kernel's disk-cache key the same in every process (kernel_cache.stable_closure_keys)
    from moebus.cuda.kernels.kernel_cache import stable_closure_keys  # noqa: E402

    stable_closure_keys()
WARP = 32
FULL_MASK = 0xFFFFFFFF
MAX_BLOCK_THREADS = 1024
MAX_WARPS = MAX_BLOCK_THREADS // WARP
MAX_SUM_MANY = 16  # most values one warp_sum_many call reduces (the simulator buffers this many)
SIM_MAX_THREADS = 64  # simulator: Python threads per block
SIM_MAX_BLOCKS = 2  # simulator: blocks of a grid-stride kernel


def threads(preferred: int) -> int:
    """Threads per block for a grid-stride kernel (a multiple of 32)."""
    return min(preferred, SIM_MAX_THREADS) if SIMULATOR else preferred


def blocks(needed: int) -> int:
    """Blocks for a grid-stride kernel that would like ``needed`` of them."""
    needed = max(int(needed), 1)
    return min(needed, SIM_MAX_BLOCKS) if SIMULATOR else needed


_KERNELS = []  # every kernel this process defined, for disk_cache_counts


def kernel(fn):
    """A kernel with the project's jit options. ``cache=True``: a compiled kernel is kept on disk
    (under NUMBA_CACHE_DIR, see kernel_cache.py) and the next process loads it instead of compiling;
    kernels built by a factory are cached too (numba's key hashes the closure's values). The
    simulator ignores the option."""
    jitted = cuda.jit(cache=True)(fn) if SIMULATOR or _can_write(_numba_config.CACHE_DIR) else cuda.jit(fn)
    _KERNELS.append(jitted)
    return jitted


def disk_cache_counts() -> tuple[int, int]:
    """(kernel variants loaded from the disk cache, kernel variants compiled) in this process so
    far; (0, 0) in the simulator, which compiles nothing."""
    stats = [k.stats for k in _KERNELS if hasattr(k, "stats")]
    return sum(sum(s.cache_hits.values()) for s in stats), sum(sum(s.cache_misses.values()) for s in stats)


def bounded_kernel(threads: int, min_blocks: int):
    """``kernel`` compiled for at least ``min_blocks`` blocks of ``threads`` an SM (numba's launch_bounds:
    registers capped at what they allow); 0 or a numba without the option: a plain ``kernel``."""
    def decorate(fn):
        if min_blocks <= 0 or SIMULATOR:
            return kernel(fn)
        try:
            options = {"cache": True} if _can_write(_numba_config.CACHE_DIR) else {}
            jitted = cuda.jit(launch_bounds=(threads, min_blocks), **options)(fn)
        except TypeError:  # numba-cuda before launch_bounds
            return kernel(fn)
        _KERNELS.append(jitted)
        return jitted
    return decorate


@functools.cache
def _can_write(path: str) -> bool:
    # numba would fall back to a directory outside the fingerprinted tree (beside the sources,
    # ~/.cache/numba) where an edit elsewhere in moebus/cuda goes unseen: rather compile each time
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError as exc:
        logging.getLogger("moebus.cuda").warning("kernels are not cached on disk: %s", exc)
        return False


def load_numba_target() -> None:
    """Fill numba's CUDA target (its typing and lowering registries) now rather than at the first
    kernel the process compiles or loads from the disk cache, where it costs the better part of a
    second even when every kernel is cached. It touches no device (no context, no thread), so the
    vision zygote does it before it forks and each vision worker inherits it."""
    if not SIMULATOR:
        from numba.cuda.descriptor import cuda_target

        cuda_target.target_context.refresh()


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


if SIMULATOR:
    # plain Python (see sim_warps.py): nothing there needs the simulated `cuda` module
    from moebus.cuda.kernels import sim_blocks, sim_warps
    from moebus.cuda.kernels.sim_warps import bits_as_f32, f32_bits, warp_argmax, warp_max, warp_sum, warp_sum_many  # noqa: F401

    sim_warps.make_shared_allocation_thread_safe()
    sim_blocks.install()

else:

    @device
    def bits_as_f32(bits):
        """float32 whose bit pattern is the low 32 bits of an integer."""
        return cuda.libdevice.int_as_float(int32(bits))

    @device
    def f32_bits(value):
        """The bit pattern of a float32, as an unsigned integer."""
        return uint32(cuda.libdevice.float_as_int(float32(value)))

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
        """values[i] = warp sum of values[i] for i < count (<= MAX_SUM_MANY)."""
        for i in range(count):
            values[i] = warp_sum(values[i])


# -- block reductions -----------------------------------------------------------------------------
# On the GPU: warp partials through shared memory, then every warp reduces the same partials in
# the same order, so every thread gets the same bits without a broadcast barrier. The simulator's
# versions use one double-buffered shared array and a single syncthreads (its barriers are what
# costs there); the tests run the tree versions under the simulator too.

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
    @cuda.jit(device=True)
    def block_sum(value):
        buf = cuda.shared.array((2, MAX_BLOCK_THREADS), float32)
        half = sim_warps.block_half()
        buf[half, cuda.threadIdx.x] = value
        cuda.syncthreads()
        return buf[half, : cuda.blockDim.x].sum(dtype=np.float32)

    @cuda.jit(device=True)
    def block_max(value):
        buf = cuda.shared.array((2, MAX_BLOCK_THREADS), float32)
        half = sim_warps.block_half()
        buf[half, cuda.threadIdx.x] = value
        cuda.syncthreads()
        return buf[half, : cuda.blockDim.x].max()

    @cuda.jit(device=True)
    def block_argmax(value, index):
        vals = cuda.shared.array((2, MAX_BLOCK_THREADS), float32)
        idxs = cuda.shared.array((2, MAX_BLOCK_THREADS), int64)
        half = sim_warps.block_half()
        vals[half, cuda.threadIdx.x] = value
        idxs[half, cuda.threadIdx.x] = index
        cuda.syncthreads()
        return sim_warps.argmax_of(vals[half, : cuda.blockDim.x], idxs[half, : cuda.blockDim.x])

else:
    block_sum, block_max, block_argmax = tree_block_sum, tree_block_max, tree_block_argmax
