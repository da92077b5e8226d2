"""Embedding gather: token ids -> float32 rows of the (bf16/f16/f32) table. The stage also gathers
rows of float32 hidden states with it (the last token of each sequence)."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.compat import blocks, cuda, float32, threads, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, require
from moebus.cuda.kernels.loads import SCALAR, storage_of

NAN = float32(np.nan)


def embedding_ref(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    # table (V, D) stored weights; ids (T,) int32 -> (T, D) float32
    return to_f32(table[np.asarray(ids, dtype=np.int64)])


# -- cuda -----------------------------------------------------------------------------------------

@functools.cache
def _embedding_kernel(storage: str):
    load = SCALAR[storage]

    @kernel
    def gather_rows(table, ids, out):
        # one block per token (grid-stride), threads across the row
        grid_dependency_wait()  # pdl.py: before any global read or write
        num_tokens, dim = out.shape
        for t in range(cuda.blockIdx.x, num_tokens, cuda.gridDim.x):
            row = ids[t]
            valid = 0 <= row < table.shape[0]  # an id out of range must not read outside the table
            for d in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
                out[t, d] = load(table, row, d) if valid else NAN

    return gather_rows


def embedding_cuda(table, ids, out, stream=0):
    """out (T, D) float32 = rows ``ids`` (T,) int32 of ``table`` (V, D) stored; NaN rows for bad ids."""
    require("table", table, WEIGHT_DTYPES, ndim=2)
    require("ids", ids, np.int32, ndim=1)
    require("out", out, np.float32, shape=(ids.shape[0], table.shape[1]))
    if ids.shape[0] == 0:
        return out
    _embedding_kernel(storage_of(table))[blocks(ids.shape[0]), threads(256), stream](table, ids, out)
    return out
