"""Fused decode kernels: fewer launches and one pass over the activations where the unfused ops
would each be a tiny, latency-bound kernel (measured: a warp-per-row rmsnorm of 2048 took 18 us).

- ``add_rmsnorm``: s = x + y (the residual add) and rmsnorm(s) in one kernel, a block per row, so
  the sum's square reduction runs over 256 threads instead of one warp's 64 serial loads.
- ``head_norm_rope``: Qwen3's per-head q/k rmsnorm followed by RoPE, one warp per (token, head)
  row; a lane holds elements l, l + 32, l + 64, l + 96 of a 128-wide head, so both halves of each
  rotated pair are in its registers.

References are the unfused references composed, so the tests hold the kernels to the same maths."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.compat import WARP, block_sum, blocks, cuda, float32, threads, warp_sum
from moebus.cuda.launch import WEIGHT_DTYPES, ceil_div, require
from moebus.cuda.loads import SCALAR, reader_view, storage_of
from moebus.cuda.rmsnorm import rmsnorm_ref
from moebus.cuda.rope import rope_ref

ROW_THREADS = 256
HEAD_WARPS = 4
MAX_PER_LANE = 8  # head_dim <= 256


def add_rmsnorm_ref(x, y, weight, eps: float):
    # x, y (R, D) float32 -> (s, rmsnorm(s)) with s = x + y
    total = (np.asarray(x, np.float32) + np.asarray(y, np.float32)).astype(np.float32)
    return total, rmsnorm_ref(total, weight, eps)


def head_norm_rope_ref(x, weight, eps: float, positions, cos, sin):
    # x (T, H, hd) float32, weight (hd,) -> rope(rmsnorm per head)
    num_tokens, num_heads, head_dim = x.shape
    normed = rmsnorm_ref(np.asarray(x).reshape(-1, head_dim), weight, eps).reshape(x.shape)
    return rope_ref(normed, positions, cos, sin)


@functools.cache
def _add_rmsnorm_kernel(storage: str):
    load_weight = SCALAR[storage]

    @cuda.jit
    def add_rmsnorm_rows(x, y, weight, eps, total, out):
        num_rows, dim = x.shape
        for row in range(cuda.blockIdx.x, num_rows, cuda.gridDim.x):  # same trip count in the block
            square_sum = float32(0.0)
            for d in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
                value = x[row, d] + y[row, d]
                total[row, d] = value
                square_sum += value * value
            square_sum = block_sum(square_sum)
            inv_rms = float32(1.0) / math.sqrt(square_sum / float32(dim) + eps)
            for d in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
                out[row, d] = load_weight(weight, 0, d) * (total[row, d] * inv_rms)  # own writes: no barrier

    return add_rmsnorm_rows


def add_rmsnorm_cuda(x, y, weight, eps: float, total, out, stream=0):
    """(total, out) = add_rmsnorm_ref(x, y, weight, eps) into float32 device arrays (R, D)."""
    num_rows, dim = x.shape
    for name, a in (("x", x), ("y", y), ("total", total), ("out", out)):
        require(name, a, np.float32, shape=(num_rows, dim))
    require("weight", weight, WEIGHT_DTYPES, shape=(dim,))
    if num_rows:
        kernel = _add_rmsnorm_kernel(storage_of(weight))
        kernel[blocks(num_rows), threads(ROW_THREADS), stream](
            x, y, reader_view(weight, wide=False), np.float32(eps), total, out)
    return total, out


@functools.cache
def _head_norm_rope_kernel(storage: str, head_dim: int):
    load_weight = SCALAR[storage]
    per_lane = head_dim // WARP
    half = head_dim // 2
    half_lanes = per_lane // 2  # a lane's elements i < per_lane / 2 are in the first half

    @cuda.jit
    def head_norm_rope_rows(x, weight, eps, positions, cos, sin, out):
        num_tokens, num_heads, _ = x.shape
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        num_rows = num_tokens * num_heads
        values = cuda.local.array(per_lane, float32)
        for start in range(0, num_rows, stride):
            row = min(start + first, num_rows - 1)
            t = row // num_heads
            h = row % num_heads
            square_sum = float32(0.0)
            for i in range(per_lane):
                values[i] = x[t, h, lane + i * WARP]
                square_sum += values[i] * values[i]
            square_sum = warp_sum(square_sum)
            inv_rms = float32(1.0) / math.sqrt(square_sum / float32(head_dim) + eps)
            for i in range(per_lane):
                values[i] = load_weight(weight, 0, lane + i * WARP) * (values[i] * inv_rms)
            position = positions[t]
            if start + first < num_rows:
                for i in range(half_lanes):
                    d = lane + i * WARP  # d < half; its partner d + half is element i + half_lanes
                    c = cos[position, d]
                    s = sin[position, d]
                    x1 = values[i]
                    x2 = values[i + half_lanes]
                    out[t, h, d] = x1 * c - x2 * s
                    out[t, h, d + half] = x2 * c + x1 * s

    return head_norm_rope_rows


def head_norm_rope_cuda(x, weight, eps: float, positions, cos, sin, out, stream=0):
    """out (T, H, hd) = head_norm_rope_ref(...); hd a multiple of 64, at most 256."""
    num_tokens, num_heads, head_dim = x.shape
    require("x", x, np.float32, ndim=3)
    require("weight", weight, WEIGHT_DTYPES, shape=(head_dim,))
    require("positions", positions, np.int32, shape=(num_tokens,))
    require("cos", cos, np.float32, shape=(None, head_dim // 2))
    require("sin", sin, np.float32, shape=tuple(cos.shape))
    require("out", out, np.float32, shape=tuple(x.shape))
    if head_dim % (2 * WARP) or head_dim > MAX_PER_LANE * WARP:
        raise ValueError(f"head_dim {head_dim}: the fused kernel takes multiples of 64 up to 256")
    rows = num_tokens * num_heads
    if rows:
        block = threads(HEAD_WARPS * WARP)
        kernel = _head_norm_rope_kernel(storage_of(weight), head_dim)
        kernel[blocks(ceil_div(rows, block // WARP)), block, stream](
            x, reader_view(weight, wide=False), np.float32(eps), positions, cos, sin, out)
    return out


def can_fuse_heads(head_dim: int) -> bool:
    return head_dim % (2 * WARP) == 0 and head_dim <= MAX_PER_LANE * WARP
