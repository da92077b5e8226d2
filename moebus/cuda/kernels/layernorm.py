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
# Each lane's part of a row is read UNROLL elements (UNROLL x 32 apart) at a time, all loads issued
# before the sums that take them (a loop of one load and one add per element waits out each load's
# latency), each lane's sums still in the order d = lane, lane + 32, ...: the results are those of
# the plain loop bit for bit. Indices past the row are clamped for the load and their values unused.

@device
def _row_sum(x, row, dim, lane):
    total = float32(0.0)
    for d in range(lane, dim, 4 * WARP):
        a0 = x[row, d]
        a1 = x[row, min(d + WARP, dim - 1)]
        a2 = x[row, min(d + 2 * WARP, dim - 1)]
        a3 = x[row, min(d + 3 * WARP, dim - 1)]
        total += a0
        if d + WARP < dim:
            total += a1
        if d + 2 * WARP < dim:
            total += a2
        if d + 3 * WARP < dim:
            total += a3
    return total


@device
def _centered_square_sum(x, row, dim, lane, mean):
    total = float32(0.0)
    for d in range(lane, dim, 4 * WARP):
        a0 = x[row, d] - mean
        a1 = x[row, min(d + WARP, dim - 1)] - mean
        a2 = x[row, min(d + 2 * WARP, dim - 1)] - mean
        a3 = x[row, min(d + 3 * WARP, dim - 1)] - mean
        total += a0 * a0
        if d + WARP < dim:
            total += a1 * a1
        if d + 2 * WARP < dim:
            total += a2 * a2
        if d + 3 * WARP < dim:
            total += a3 * a3
    return total


@device
def row_mean_inv_std(x, row, dim, lane, eps):
    """(mean, 1 / sqrt(var + eps)) of x[row, :dim] over one warp's lanes, in two passes (mean, then
    the centered variance: no cancellation); every lane gets both."""
    mean = warp_sum(_row_sum(x, row, dim, lane)) / float32(dim)
    return mean, _inv_std(x, row, dim, lane, mean, eps)


@device
def _inv_std(x, row, dim, lane, mean, eps):
    return float32(1.0) / math.sqrt(warp_sum(_centered_square_sum(x, row, dim, lane, mean)) / float32(dim) + eps)


@device
def store_row(out, r, d, value):
    out[r, d] = value


def _normed_stores(store, load):
    """The last pass of a row: out[row, d] = (x[row, d] - mean) * inv_std * w[d] + b[d] via
    ``store``, four elements' loads at a time."""

    @device
    def normed_stores(x, weight, bias, out, row, dim, lane, mean, inv_std):
        for d in range(lane, dim, 4 * WARP):
            d1, d2, d3 = min(d + WARP, dim - 1), min(d + 2 * WARP, dim - 1), min(d + 3 * WARP, dim - 1)
            a0, a1, a2, a3 = x[row, d], x[row, d1], x[row, d2], x[row, d3]
            w0, w1, w2, w3 = load(weight, 0, d), load(weight, 0, d1), load(weight, 0, d2), load(weight, 0, d3)
            b0, b1, b2, b3 = load(bias, 0, d), load(bias, 0, d1), load(bias, 0, d2), load(bias, 0, d3)
            store(out, row, d, (a0 - mean) * inv_std * w0 + b0)
            if d + WARP < dim:
                store(out, row, d1, (a1 - mean) * inv_std * w1 + b1)
            if d + 2 * WARP < dim:
                store(out, row, d2, (a2 - mean) * inv_std * w2 + b2)
            if d + 3 * WARP < dim:
                store(out, row, d3, (a3 - mean) * inv_std * w3 + b3)

    return normed_stores


@functools.cache
def _layernorm_kernel(storage: str, store=store_row):
    """The LayerNorm kernel for weights of ``storage``; ``store(out, r, d, value)`` writes each result
    (float32 here; split_epilogues.py's store writes a product's bf16 parts)."""
    stores = _normed_stores(store, SCALAR[storage])

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
                stores(x, weight, bias, out, row, dim, lane, mean, inv_std)

    return layernorm_rows


@functools.cache
def residual_layernorm_kernel(storage: str, residual_storage: str, store=store_row):
    """x_out = x + (y + residual_bias) (tiled_linear.bias_residual_ref) and out = LayerNorm(x_out)
    stored by ``store``, in one pass over x and y: the same float32 operations, in the same order,
    as bias_residual then the LayerNorm kernel, so both results equal theirs bit for bit."""
    load_residual = SCALAR[residual_storage]
    stores = _normed_stores(store, SCALAR[storage])

    @kernel
    def residual_layernorm_rows(x, y, residual_bias, weight, bias, eps, x_out, out):
        # one warp per row as layernorm_rows; the sum pass forms x + (y + b) and stores it (a warp
        # past the last row recomputes that row and stores nothing), the other two passes read it back
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        num_rows, dim = x.shape
        for start in range(0, num_rows, stride):
            row = min(start + first, num_rows - 1)
            owner = start + first < num_rows
            total = float32(0.0)
            for d in range(lane, dim, 4 * WARP):
                d1, d2, d3 = min(d + WARP, dim - 1), min(d + 2 * WARP, dim - 1), min(d + 3 * WARP, dim - 1)
                x0, x1, x2, x3 = x[row, d], x[row, d1], x[row, d2], x[row, d3]
                y0, y1, y2, y3 = y[row, d], y[row, d1], y[row, d2], y[row, d3]
                s0 = x0 + (y0 + load_residual(residual_bias, 0, d))
                s1 = x1 + (y1 + load_residual(residual_bias, 0, d1))
                s2 = x2 + (y2 + load_residual(residual_bias, 0, d2))
                s3 = x3 + (y3 + load_residual(residual_bias, 0, d3))
                total += s0
                if owner:
                    x_out[row, d] = s0
                if d + WARP < dim:
                    total += s1
                    if owner:
                        x_out[row, d1] = s1
                if d + 2 * WARP < dim:
                    total += s2
                    if owner:
                        x_out[row, d2] = s2
                if d + 3 * WARP < dim:
                    total += s3
                    if owner:
                        x_out[row, d3] = s3
            mean = warp_sum(total) / float32(dim)
            inv_std = _inv_std(x_out, row, dim, lane, mean, eps)  # each lane reads back what it stored
            if owner:
                stores(x_out, weight, bias, out, row, dim, lane, mean, inv_std)

    return residual_layernorm_rows


def layernorm_cuda(x, weight, bias, eps: float, out, stream=0):
    """out = layernorm_ref(x, weight, bias, eps); x, out (R, D) float32, weight and bias (D,) stored."""
    num_rows, dim = x.shape
    require("x", x, np.float32, ndim=2)
    require("weight", weight, WEIGHT_DTYPES, shape=(dim,))
    require("bias", bias, (weight.dtype,), shape=(dim,))
    require("out", out, np.float32, shape=(num_rows, dim))
    if num_rows == 0:
        return out
    grid, block = warp_per_row(num_rows, min(block_warps(dim), num_rows))
    kernel = rows_kernel(storage_of(weight), dim, store_row, out)
    kernel[grid, block, stream](x, reader_view(weight, wide=False), reader_view(bias, wide=False), np.float32(eps), out)
    return out


def block_warps(dim: int) -> int:
    """Warps (rows) a block of the LayerNorm kernel for rows of ``dim`` takes."""
    from moebus.cuda.kernels import layernorm_held

    return layernorm_held.BLOCK_WARPS if layernorm_held.per_lane(dim) else MAX_WARPS


def rows_kernel(storage: str, dim: int, store, out):
    """The LayerNorm kernel for rows of ``dim`` stored into ``out`` by ``store``: each row held in
    registers where layernorm_held takes it (the same results bit for bit), else this module's."""
    from moebus.cuda.kernels import layernorm_held

    count = layernorm_held.per_lane(dim)
    if not count:
        return _layernorm_kernel(storage, store)
    return layernorm_held.layernorm_kernel(storage, count, layernorm_held.unrolled_store(store, out))


def residual_layernorm_ref(x, y, residual_bias, weight, bias, eps: float) -> tuple[np.ndarray, np.ndarray]:
    # (x + (y + residual_bias), its LayerNorm): x, y (R, D) float32, the biases and weight (D,) stored
    from moebus.cuda.kernels.tiled_linear import bias_residual_ref

    summed = bias_residual_ref(x, y, residual_bias)
    return summed, layernorm_ref(summed, weight, bias, eps)


def residual_layernorm_cuda(x, y, residual_bias, weight, bias, eps: float, x_out, out, stream=0):
    """(x_out, out) = residual_layernorm_ref(...) on device arrays: x, y, x_out (R, D) float32; out
    (R, D) float32, or the (parts, R, D) bf16 parts of the result (split_epilogues)."""
    num_rows, dim = x.shape
    require("x", x, np.float32, ndim=2)
    require("y", y, np.float32, shape=(num_rows, dim))
    require("x_out", x_out, np.float32, shape=(num_rows, dim))
    require("residual_bias", residual_bias, WEIGHT_DTYPES, shape=(dim,))
    require("weight", weight, WEIGHT_DTYPES, shape=(dim,))
    require("bias", bias, (weight.dtype,), shape=(dim,))
    split = len(out.shape) == 3
    if split:
        from moebus.cuda.kernels.split_epilogues import _check_out, _store_split

        _check_out(out, num_rows, dim)
    else:
        require("out", out, np.float32, shape=(num_rows, dim))
    if num_rows:
        grid, block = warp_per_row(num_rows, min(block_warps(dim), num_rows))
        from moebus.cuda.kernels import layernorm_held

        store, count = _store_split if split else store_row, layernorm_held.per_lane(dim)
        kernel = layernorm_held.residual_layernorm_kernel(storage_of(weight), storage_of(residual_bias), count,
                                                          layernorm_held.unrolled_store(store, out)) \
            if count else residual_layernorm_kernel(storage_of(weight), storage_of(residual_bias), store)
        kernel[grid, block, stream](x, y, reader_view(residual_bias, wide=False), reader_view(weight, wide=False),
                                    reader_view(bias, wide=False), np.float32(eps), x_out, out)
    return x_out, out
