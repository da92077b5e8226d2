"""RMSNorm over the last axis, also used per head for Qwen3's q/k norm (rows = tokens x heads): a
warp per row for short rows (heads), a block of 1024 threads per row for wide ones (a model's hidden
size: one warp took 30 us for a 2048-wide row on an H200, a chain of 64 dependent loads)."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import WARP, block_sum, blocks, cuda, float32, threads, warp_sum, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, require, warp_per_row
from moebus.cuda.kernels.loads import SCALAR, reader_view, storage_of

MAX_WARPS = 4  # warps (rows in flight) per block
WIDE_ROW = 512  # rows at least this wide get a block each
ROW_THREADS = 1024


def rmsnorm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x (R, D) float32, weight (D,) stored -> (R, D) float32; as transformers: w * (x * rsqrt(mean(x^2) + eps))
    x = np.asarray(x, dtype=np.float32)
    variance = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return to_f32(weight) * (x * (1.0 / np.sqrt(variance + np.float32(eps))).astype(np.float32))


# -- cuda -----------------------------------------------------------------------------------------

@functools.cache
def _rmsnorm_kernel(storage: str):
    load_weight = SCALAR[storage]

    @kernel
    def rmsnorm_rows(x, weight, eps, out):
        # one warp per row; rows grid-stride with the same trip count in every warp (compat's rule)
        grid_dependency_wait()  # pdl.py: before any global read or write
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        num_rows, dim = x.shape
        for start in range(0, num_rows, stride):
            row = min(start + first, num_rows - 1)
            square_sum = float32(0.0)
            for d in range(lane, dim, WARP):
                value = x[row, d]
                square_sum += value * value
            square_sum = warp_sum(square_sum)
            inv_rms = float32(1.0) / math.sqrt(square_sum / float32(dim) + eps)
            if start + first < num_rows:
                for d in range(lane, dim, WARP):
                    out[row, d] = load_weight(weight, 0, d) * (x[row, d] * inv_rms)

    return rmsnorm_rows


@functools.cache
def _wide_rmsnorm_kernel(storage: str, per_thread: int):
    load_weight = SCALAR[storage]

    @kernel
    def rmsnorm_wide_rows(x, weight, eps, out):
        # a block per row; thread i holds elements i, i + blockDim, ... in registers (one pass)
        grid_dependency_wait()  # pdl.py: before any global read or write
        num_rows, dim = x.shape
        tid, step = cuda.threadIdx.x, cuda.blockDim.x
        values = cuda.local.array(per_thread, float32)
        for row in range(cuda.blockIdx.x, num_rows, cuda.gridDim.x):  # same trip count in the block
            square_sum = float32(0.0)
            for i in range(per_thread):
                values[i] = x[row, min(tid + i * step, dim - 1)]
            for i in range(per_thread):
                if tid + i * step < dim:
                    square_sum += values[i] * values[i]
            inv_rms = float32(1.0) / math.sqrt(block_sum(square_sum) / float32(dim) + eps)
            for i in range(per_thread):
                d = tid + i * step
                if d < dim:
                    out[row, d] = load_weight(weight, 0, d) * (values[i] * inv_rms)

    return rmsnorm_wide_rows


def rmsnorm_cuda(x, weight, eps: float, out, stream=0):
    """out = rmsnorm_ref(x, weight, eps); x, out (R, D) float32 device arrays, weight (D,) stored."""
    num_rows, dim = x.shape
    require("x", x, np.float32, ndim=2)
    require("weight", weight, WEIGHT_DTYPES, shape=(dim,))
    require("out", out, np.float32, shape=(num_rows, dim))
    if num_rows == 0:
        return out
    if dim >= WIDE_ROW:
        block = threads(ROW_THREADS)
        kernel = _wide_rmsnorm_kernel(storage_of(weight), -(-dim // block))
        kernel[blocks(num_rows), block, stream](x, reader_view(weight, wide=False), np.float32(eps), out)
        return out
    grid, block = warp_per_row(num_rows, min(MAX_WARPS, num_rows))
    kernel = _rmsnorm_kernel(storage_of(weight))
    kernel[grid, block, stream](x, reader_view(weight, wide=False), np.float32(eps), out)
    return out
