"""Embedding gather: token ids -> float32 rows of the (bf16/f16/f32) table. The stage also gathers
rows of float32 hidden states with it (the last token of each sequence).

On cuda the token embedding lives in pinned host memory mapped into the device
(CudaBackend.token_table): each load is a PCIe round trip (~1-2 us), so a thread issues its
``PER_THREAD`` loads before any store (stores to ``out`` could alias the table, so a load after a
store waits for it): a 2,048-wide row is one round trip at 512 threads, where a load-store loop
made it eight."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.compat import blocks, cuda, float32, threads, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, require
from moebus.cuda.kernels.loads import SCALAR, storage_of

NAN = float32(np.nan)
PER_THREAD = 4  # loads a thread has in flight before it stores them
ROW_THREADS = 512


def embedding_ref(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    # table (V, D) stored weights; ids (T,) int32 -> (T, D) float32
    return to_f32(table[np.asarray(ids, dtype=np.int64)])


# -- cuda -----------------------------------------------------------------------------------------

@functools.cache
def _embedding_kernel(storage: str):
    load = SCALAR[storage]

    @kernel
    def gather_rows(table, ids, out):
        # one block per token (grid-stride), threads across the row, PER_THREAD loads in flight each
        grid_dependency_wait()  # pdl.py: before any global read or write
        num_tokens, dim = out.shape
        stride = cuda.blockDim.x
        for t in range(cuda.blockIdx.x, num_tokens, cuda.gridDim.x):
            row = ids[t]
            valid = 0 <= row < table.shape[0]  # an id out of range must not read outside the table
            for d0 in range(cuda.threadIdx.x, dim, stride * PER_THREAD):
                d1, d2, d3 = d0 + stride, d0 + 2 * stride, d0 + 3 * stride
                v0 = load(table, row, d0) if valid else NAN
                v1 = load(table, row, d1) if valid and d1 < dim else NAN
                v2 = load(table, row, d2) if valid and d2 < dim else NAN
                v3 = load(table, row, d3) if valid and d3 < dim else NAN
                out[t, d0] = v0
                if d1 < dim:
                    out[t, d1] = v1
                if d2 < dim:
                    out[t, d2] = v2
                if d3 < dim:
                    out[t, d3] = v3

    return gather_rows


def embedding_cuda(table, ids, out, stream=0):
    """out (T, D) float32 = rows ``ids`` (T,) int32 of ``table`` (V, D) stored; NaN rows for bad ids."""
    require("table", table, WEIGHT_DTYPES, ndim=2)
    require("ids", ids, np.int32, ndim=1)
    require("out", out, np.float32, shape=(ids.shape[0], table.shape[1]))
    if ids.shape[0] == 0:
        return out
    _embedding_kernel(storage_of(table))[blocks(ids.shape[0]), threads(ROW_THREADS), stream](table, ids, out)
    return out
