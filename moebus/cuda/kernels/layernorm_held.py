"""LayerNorm (and the residual add before it) with each row held in registers: layernorm.py's kernels
read a row three times from memory (the sum, the centered variance, the normed stores), one load
after another per element group, so a warp waits out a memory latency per group and pass. Here a
lane loads its ``per_lane`` elements of the row once, all of them before the first sum, and the
variance and the stores take them from registers.

The arithmetic is layernorm.py's, in its order: each lane sums its elements d = lane, lane + 32, ...
in turn, the warp sums by the same butterfly, the same expressions for the variance, 1 / std and
the normed value. So every result equals layernorm.py's bit for bit (tests/cuda/test_layernorm_held.py; on the
H200 the a3b tower's outputs too, and its residual + LayerNorm pass 38.3 -> 33.3 us: docs/performance.md,
fifteenth session).

Rows of up to ``MAX_PER_LANE`` x 32 elements (the towers' hidden rows: 1152 = 36 a lane); wider ones
(a DeepStack merger's 4608) keep layernorm.py's kernels. ``HELD`` (``MOEBUS_LAYERNORM_HELD``, default 1; 0 for
layernorm.py's kernels everywhere) is read where the launch wrappers choose."""
from __future__ import annotations

import functools
import math
import os

from moebus.cuda.kernels.compat import WARP, cuda, device, float32, kernel, uint64, warp_sum
from moebus.cuda.kernels.loads import SCALAR
from moebus.cuda.kernels.pdl import grid_dependency_wait

HELD = os.environ.get("MOEBUS_LAYERNORM_HELD", "1") != "0"
# warps (rows) a block of the held kernels: at 134-182 registers a thread an SM holds 2-3 blocks of 4 (8-12
# warps); smaller blocks fill the registers closer (MOEBUS_LAYERNORM_HELD_WARPS; the same results; an A/B of
# tools/device/vl15_encode.py, not yet measured)
BLOCK_WARPS = int(os.environ.get("MOEBUS_LAYERNORM_HELD_WARPS", "4"))
MAX_PER_LANE = 40  # elements a lane holds (registers): rows of up to 1280 (at 48 the compiler keeps them in local memory)


def per_lane(dim: int) -> int:
    """Elements of a ``dim``-wide row each lane holds, or 0 where the row is too wide to hold."""
    count = -(-dim // WARP)
    return count if HELD and 0 < count <= MAX_PER_LANE else 0


def unrolled_store(store, out):
    """``store`` as the held kernels take it: split_epilogues' store of a (2, R, D) split result as
    two plain stores (its loop over the parts, of a trip count known only at run time, keeps the
    compiler from unrolling the stores' loop, and the held row then goes to local memory)."""
    from moebus.cuda.kernels.split_epilogues import _store_split
    from moebus.cuda.kernels.split_two_parts import store_two_parts

    return store_two_parts if store is _store_split and len(out.shape) == 3 and out.shape[0] == 2 else store


def _normed(store, load, count):
    """The last pass over a held row: out[row, d] = (held - mean) * inv_std * w[d] + b[d] via ``store``."""

    @device
    def normed(held, weight, bias, out, row, dim, lane, mean, inv_std):
        for i in range(count):
            d = lane + uint64(i * WARP)
            if d < dim:
                store(out, row, d, (held[i] - mean) * inv_std * load(weight, 0, d) + load(bias, 0, d))

    return normed


def _statistics(count):
    """(mean, 1 / sqrt(var + eps)) of a held row, as layernorm.row_mean_inv_std sums them."""

    @device
    def statistics(held, dim, lane, eps):
        total = float32(0.0)
        for i in range(count):
            if lane + uint64(i * WARP) < dim:
                total += held[i]
        mean = warp_sum(total) / float32(dim)
        squares = float32(0.0)
        for i in range(count):
            if lane + uint64(i * WARP) < dim:
                centered = held[i] - mean
                squares += centered * centered
        return mean, float32(1.0) / math.sqrt(warp_sum(squares) / float32(dim) + eps)

    return statistics


@functools.cache
def layernorm_kernel(storage: str, count: int, store):
    """layernorm._layernorm_kernel(storage, store) over rows of at most ``count`` x 32 elements, held."""
    stats, normed = _statistics(count), _normed(store, SCALAR[storage], count)

    @kernel
    def layernorm_held_rows(x, weight, bias, eps, out):
        # one warp per row, grid-stride with the same trip count in every warp (compat's rule)
        grid_dependency_wait()  # pdl.py: before any global read or write
        lane = uint64(cuda.threadIdx.x % WARP)  # unsigned columns: no wraparound for negative indices to compute
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        num_rows, dim = x.shape[0], uint64(x.shape[1])
        held = cuda.local.array(count, float32)
        for start in range(0, num_rows, stride):
            row = min(start + first, num_rows - 1)
            for i in range(count):  # every load first
                held[i] = x[row, lane + uint64(i * WARP)] if lane + uint64(i * WARP) < dim else float32(0.0)
            mean, inv_std = stats(held, dim, lane, eps)
            if start + first < num_rows:
                normed(held, weight, bias, out, row, dim, lane, mean, inv_std)

    return layernorm_held_rows


@functools.cache
def residual_layernorm_kernel(storage: str, residual_storage: str, count: int, store):
    """layernorm.residual_layernorm_kernel over rows of at most ``count`` x 32 elements, held: x_out =
    x + (y + residual_bias) stored as it is formed, its LayerNorm from the held sums."""
    load_residual = SCALAR[residual_storage]
    stats, normed = _statistics(count), _normed(store, SCALAR[storage], count)

    @kernel
    def residual_layernorm_held_rows(x, y, residual_bias, weight, bias, eps, x_out, out):
        grid_dependency_wait()  # pdl.py: before any global read or write
        lane = uint64(cuda.threadIdx.x % WARP)  # unsigned columns: no wraparound for negative indices to compute
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        num_rows, dim = x.shape[0], uint64(x.shape[1])
        held = cuda.local.array(count, float32)
        for start in range(0, num_rows, stride):
            row = min(start + first, num_rows - 1)
            owner = start + first < num_rows
            for i in range(count):  # every load first, as in layernorm_held_rows
                d = lane + uint64(i * WARP)
                held[i] = x[row, d] + (y[row, d] + load_residual(residual_bias, 0, d)) if d < dim else float32(0.0)
            if owner:
                for i in range(count):
                    if lane + uint64(i * WARP) < dim:
                        x_out[row, lane + uint64(i * WARP)] = held[i]
            mean, inv_std = stats(held, dim, lane, eps)
            if owner:
                normed(held, weight, bias, out, row, dim, lane, mean, inv_std)

    return residual_layernorm_held_rows
