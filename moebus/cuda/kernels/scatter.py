"""Row scatter: rows of a (T, D) activation replaced by given rows, in place. Stage 0 puts image
embeddings at the image-token positions of the token embeddings with it."""
from __future__ import annotations

import numpy as np

from moebus.cuda.kernels.compat import blocks, cuda, threads, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import ceil_div, require

THREADS = 256


def scatter_rows_ref(x: np.ndarray, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    # x (T, D) float32 written in place: x[rows[r]] = values[r]; rows (R,) int32, values (R, D) float32
    x[np.asarray(rows, dtype=np.int64)] = values
    return x


@kernel
def scatter_rows_flat(x, rows, values):
    grid_dependency_wait()  # pdl.py: before any global read or write
    num_rows, dim = values.shape
    for i in range(cuda.grid(1), num_rows * dim, cuda.gridsize(1)):
        r, d = i // dim, i % dim
        x[rows[r], d] = values[r, d]


def scatter_rows_cuda(x, rows, values, stream=0):
    """scatter_rows_ref on device arrays (rows must be distinct and inside x: the caller checks)."""
    require("x", x, np.float32, ndim=2)
    require("rows", rows, np.int32, ndim=1)
    require("values", values, np.float32, shape=(rows.shape[0], x.shape[1]))
    if values.size:
        grid = blocks(ceil_div(values.size, THREADS))
        scatter_rows_flat[grid, threads(THREADS), stream](x, rows, values)
    return x
