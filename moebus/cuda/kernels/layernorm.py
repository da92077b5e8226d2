"""LayerNorm over the last axis with weight and bias (the vision towers' norm), as torch computes it:
(x - mean) / sqrt(var + eps) * w + b with the biased variance."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import WARP, cuda, device, float32, warp_sum, kernel
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, require, warp_per_row
from moebus.cuda.kernels.loads import SCALAR, reader_view, storage_of

MAX_WARPS = 4  # warps (rows in flight) per block


def layernorm_ref(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    # x (R, D) float32, weight and bias (D,) stored -> (R, D) float32
    x = np.asarray(x, dtype=np.float32)
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float32)
    centered = x - mean
    variance = np.mean(centered * centered, axis=-1, keepdims=True, dtype=np.float32)
    normed = centered * (np.float32(1.0) / np.sqrt(variance + np.float32(eps)))
    return normed * to_f32(weight) + to_f32(bias)


# -- cuda -----------------------------------------------------------------------------------------

@device
def row_mean_inv_std(x, row, dim, lane, eps):
    """(mean, 1 / sqrt(var + eps)) of x[row, :dim] over one warp's lanes, in two passes (mean, then
    the centered variance: no cancellation); every lane gets both."""
    total = float32(0.0)
    for d in range(lane, dim, WARP):
        total += x[row, d]
    mean = warp_sum(total) / float32(dim)
    square_sum = float32(0.0)
    for d in range(lane, dim, WARP):
        centered = x[row, d] - mean
        square_sum += centered * centered
    return mean, float32(1.0) / math.sqrt(warp_sum(square_sum) / float32(dim) + eps)


@device
def store_row(out, r, d, value):
    out[r, d] = value


@functools.cache
def _layernorm_kernel(storage: str, store=store_row):
    """The LayerNorm kernel for weights of ``storage``; ``store(out, r, d, value)`` writes each result
    (float32 here; split_epilogues.py's store writes a product's bf16 parts)."""
    load = SCALAR[storage]

    @kernel
    def layernorm_rows(x, weight, bias, eps, out):
        # one warp per row, two passes (mean, then the centered variance: no cancellation);
        # rows grid-stride with the same trip count in every warp (compat's rule)
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        num_rows, dim = x.shape
        for start in range(0, num_rows, stride):
            row = min(start + first, num_rows - 1)
            mean, inv_std = row_mean_inv_std(x, row, dim, lane, eps)
            if start + first < num_rows:
                for d in range(lane, dim, WARP):
                    store(out, row, d, (x[row, d] - mean) * inv_std * load(weight, 0, d) + load(bias, 0, d))

    return layernorm_rows


def layernorm_cuda(x, weight, bias, eps: float, out, stream=0):
    """out = layernorm_ref(x, weight, bias, eps); x, out (R, D) float32, weight and bias (D,) stored."""
    num_rows, dim = x.shape
    require("x", x, np.float32, ndim=2)
    require("weight", weight, WEIGHT_DTYPES, shape=(dim,))
    require("bias", bias, (weight.dtype,), shape=(dim,))
    require("out", out, np.float32, shape=(num_rows, dim))
    if num_rows == 0:
        return out
    grid, block = warp_per_row(num_rows, min(MAX_WARPS, num_rows))
    kernel = _layernorm_kernel(storage_of(weight))
    kernel[grid, block, stream](x, reader_view(weight, wide=False), reader_view(bias, wide=False), np.float32(eps), out)
    return out
