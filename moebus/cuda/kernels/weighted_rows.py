"""Weighted row gather: ``out[n] = sum_k weights[n, k] * table[indices[n, k]]``. Qwen3-VL's vision
tower resamples its square table of learned position embeddings to each image's patch grid this
way (bilinear: the four corner rows of each patch's place and their weights, computed on the host
by workers/qwen3vl_grid.py), as transformers' weighted ``pos_embed`` sum does."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.compat import blocks, cuda, float32, threads, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, require
from moebus.cuda.kernels.loads import SCALAR, storage_of


def weighted_rows_ref(table: np.ndarray, indices: np.ndarray, weights: np.ndarray) -> np.ndarray:
    # table (V, D) stored; indices (N, K) int32; weights (N, K) float32 -> (N, D) float32
    rows = to_f32(table[np.asarray(indices, np.int64)])  # (N, K, D)
    return (rows * np.asarray(weights, np.float32)[:, :, None]).sum(axis=1).astype(np.float32)


# -- cuda -----------------------------------------------------------------------------------------

@functools.cache
def _weighted_rows_kernel(storage: str):
    load = SCALAR[storage]

    @kernel
    def weighted_rows(table, indices, weights, out):
        # one block per output row (grid-stride), threads across the row; taps summed in order
        grid_dependency_wait()  # pdl.py: before any global read or write
        num_rows, dim = out.shape
        taps = indices.shape[1]
        for n in range(cuda.blockIdx.x, num_rows, cuda.gridDim.x):
            for d in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
                acc = float32(0.0)
                for k in range(taps):
                    acc += load(table, indices[n, k], d) * weights[n, k]
                out[n, d] = acc

    return weighted_rows


def weighted_rows_cuda(table, indices, weights, out, stream=0):
    """out (N, D) float32 = weighted_rows_ref(table, indices, weights); every index must be a row
    of ``table`` (the host computes them clamped into the table)."""
    require("table", table, WEIGHT_DTYPES, ndim=2)
    require("indices", indices, np.int32, ndim=2)
    require("weights", weights, np.float32, shape=tuple(indices.shape))
    require("out", out, np.float32, shape=(indices.shape[0], table.shape[1]))
    if indices.shape[0]:
        _weighted_rows_kernel(storage_of(table))[blocks(indices.shape[0]), threads(256), stream](
            table, indices, weights, out)
    return out
