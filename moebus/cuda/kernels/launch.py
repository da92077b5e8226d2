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
