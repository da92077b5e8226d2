"""Host-side helpers shared by the launch wrappers: argument checks that fail before a kernel runs
(a bad launch on a GPU can poison the CUDA context) and grid arithmetic."""
from __future__ import annotations

import numpy as np

from moebus.cuda.kernels.compat import WARP, blocks, is_contiguous, threads


def ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def warp_per_row(num_rows: int, warps_per_block: int) -> tuple[int, int]:
    """(blocks, threads) of a kernel that gives each row one warp, grid-stride over the rows: the
    blocks are counted from the threads a block really gets (fewer in the simulator)."""
    block = threads(warps_per_block * WARP)
    return blocks(ceil_div(num_rows, block // WARP)), block


def require(name: str, array, dtype=None, shape=None, ndim=None, contiguous: bool = True) -> None:
    """Raise TypeError/ValueError unless ``array`` has this dtype (a dtype or tuple of them), shape
    (None entries match anything), rank and C order."""
    if dtype is not None:
        allowed = tuple(np.dtype(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))
        if np.dtype(array.dtype) not in allowed:
            raise TypeError(f"{name}: dtype {array.dtype}, expected {' or '.join(map(str, allowed))}")
    if ndim is not None and len(array.shape) != ndim:
        raise ValueError(f"{name}: {len(array.shape)}-d array, expected {ndim}-d")
    if shape is not None:
        actual = tuple(array.shape)
        if len(actual) != len(shape) or any(s is not None and s != a for s, a in zip(shape, actual)):
            raise ValueError(f"{name}: shape {actual}, expected {tuple(shape)}")
    if contiguous and not is_contiguous(array):
        raise ValueError(f"{name}: must be C-contiguous")


WEIGHT_DTYPES = (np.uint16, np.float16, np.float32)


def prefer_shared_carveout(percent: int) -> int:
    """Set the preferred shared-memory carveout (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
    0 = most L1, 100 = most shared memory, -1 = the driver's choice) of every kernel this process has
    compiled so far; returns how many. For measuring whether the SMs' reconfiguration between our
    kernels and cuBLAS's costs time: a graph captured afterwards launches them with it."""
    from moebus.cuda.kernels import compat  # the registry of every kernel defined

    count = 0
    for dispatcher in compat._KERNELS:
        for compiled in getattr(dispatcher, "overloads", {}).values():
            compiled._codelibrary.get_cufunc().set_shared_memory_carveout(percent)
            compiled.shared_memory_carveout = None if percent == -1 else percent  # numba sets it again on a bind
            count += 1
    return count
