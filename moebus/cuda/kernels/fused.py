"""Fused decode kernels: fewer launches and one pass over the activations where the unfused ops
would each be a tiny, latency-bound kernel (measured: a warp-per-row rmsnorm of 2048 took 18 us).

- ``add_rmsnorm``: s = x + y (the residual add) and rmsnorm(s) in one kernel, a block of 1024
  threads per row, each holding its one or two elements in registers between the two passes (with
  256 threads and a re-read the kernel was a chain of dependent loads: 6.6 us at 2048 wide).
- ``combine_add_rmsnorm``: the MoE's weighted combine of its pairs, the residual add and the next
  norm, a block per token row; top-k is a compile-time constant so the pair loads go out together
  (22 us at 2048 wide, top-8, before).
- ``qkv_rope_store``: from the fused q | k | v projection, Qwen3's per-head q/k rmsnorm, RoPE,
  and k, v written into the KV cache (float32 or bf16), one warp per (token, head) row; a lane holds elements l,
  l + 32, l + 64, l + 96 of a 128-wide head, so both halves of each rotated pair are in its registers.

References are the unfused references composed, so the tests hold the kernels to the same maths."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import WARP, block_sum, blocks, cuda, device, float32, threads, warp_sum, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, require, warp_per_row
from moebus.cuda.kernels.loads import SCALAR, reader_view, storage_of
from moebus.cuda.kernels.attention import STORE, kv_store_ref, require_caches
from moebus.cuda.kernels.moe import combine_ref
from moebus.cuda.kernels.rmsnorm import rmsnorm_ref
from moebus.cuda.kernels.rope import rope_ref

ROW_THREADS = 1024  # a row's elements over the whole block: one or two per thread at decode widths
HEAD_WARPS = 4
MAX_PER_LANE = 8  # head_dim <= 256


def add_rmsnorm_ref(x, y, weight, eps: float):
    # x, y (R, D) float32 -> (s, rmsnorm(s)) with s = x + y
    total = (np.asarray(x, np.float32) + np.asarray(y, np.float32)).astype(np.float32)
    return total, rmsnorm_ref(total, weight, eps)


def combine_add_rmsnorm_ref(y_pair, weights, x, weight, eps: float):
    # the MoE combine (moe.combine_ref), the residual add and the next norm: (s, rmsnorm(s)), s = x + combine
    return add_rmsnorm_ref(x, combine_ref(y_pair, weights), weight, eps)


def qkv_rope_store_ref(qkv, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, token_slot,
                       token_pos, cos, sin, k_cache, v_cache):
    # qkv (T, (H + 2 KVH) hd) float32: the fused projection's columns q | k | v. Per head: rmsnorm
    # (q, k), RoPE (q, k); k and v go into the caches at (slot, position); returns q (T, H, hd)
    num_tokens = qkv.shape[0]
    hd = q_weight.shape[0]
    q = qkv[:, : num_heads * hd].reshape(num_tokens, num_heads, hd)
    k = qkv[:, num_heads * hd : (num_heads + num_kv_heads) * hd].reshape(num_tokens, num_kv_heads, hd)
    v = qkv[:, (num_heads + num_kv_heads) * hd :].reshape(num_tokens, num_kv_heads, hd)
    q = rope_ref(rmsnorm_ref(q.reshape(-1, hd), q_weight, eps).reshape(q.shape), token_pos, cos, sin)
    k = rope_ref(rmsnorm_ref(k.reshape(-1, hd), k_weight, eps).reshape(k.shape), token_pos, cos, sin)
    kv_store_ref(k_cache, v_cache, k, v, token_slot, token_pos)
    return q


@functools.cache
def _add_rmsnorm_kernel(storage: str, per_thread: int):
    store_normed = normed_store(storage, per_thread)

    load_row = row_values(per_thread)

    @kernel
    def add_rmsnorm_rows(x, y, weight, eps, total, out):
        # a block per row; thread i holds elements i, i + blockDim, ... (per_thread of them) in
        # registers: every load of the row is issued before the first use, one pass over memory
        grid_dependency_wait()  # pdl.py: before any global read or write
        num_rows, dim = x.shape
        values = cuda.local.array(per_thread, float32)
        for row in range(cuda.blockIdx.x, num_rows, cuda.gridDim.x):  # same trip count in the block
            square_sum = load_row(x, y, row, dim, values)
            store_normed(values, weight, block_sum(square_sum), dim, eps, row, total, out)

    return add_rmsnorm_rows


@functools.cache
def row_values(per_thread: int):
    """The first pass of a row kernel: values = x[row] + y[row] (this thread's elements); returns
    this thread's share of the sum of squares."""

    @device
    def add_row(x, y, row, dim, values):
        tid, step = cuda.threadIdx.x, cuda.blockDim.x
        for i in range(per_thread):
            d = min(tid + i * step, dim - 1)
            values[i] = x[row, d] + y[row, d]
        square_sum = float32(0.0)
        for i in range(per_thread):
            if tid + i * step < dim:
                square_sum += values[i] * values[i]
        return square_sum

    return add_row


@functools.cache
def normed_store(storage: str, per_thread: int):
    """The second pass of a row kernel: total = the held values, out = their rmsnorm."""
    load_weight = SCALAR[storage]

    @device
    def store_normed(values, weight, square_sum, dim, eps, row, total, out):
        inv_rms = float32(1.0) / math.sqrt(square_sum / float32(dim) + eps)
        tid, step = cuda.threadIdx.x, cuda.blockDim.x
        for i in range(per_thread):
            d = tid + i * step
            if d < dim:
                total[row, d] = values[i]
                out[row, d] = load_weight(weight, 0, d) * (values[i] * inv_rms)

    return store_normed


def _per_thread(dim: int, block: int) -> int:
    return max(1, -(-dim // block))


def add_rmsnorm_cuda(x, y, weight, eps: float, total, out, stream=0):
    """(total, out) = add_rmsnorm_ref(x, y, weight, eps) into float32 device arrays (R, D)."""
    num_rows, dim = x.shape
    for name, a in (("x", x), ("y", y), ("total", total), ("out", out)):
        require(name, a, np.float32, shape=(num_rows, dim))
    require("weight", weight, WEIGHT_DTYPES, shape=(dim,))
    if num_rows and dim:
        block = threads(ROW_THREADS)
        kernel = _add_rmsnorm_kernel(storage_of(weight), _per_thread(dim, block))
        kernel[blocks(num_rows), block, stream](x, y, reader_view(weight, wide=False), np.float32(eps), total, out)
    return total, out


@functools.cache
def _combine_add_rmsnorm_kernel(storage: str, top_k: int, per_thread: int):
    load_weight = SCALAR[storage]

    @kernel
    def combine_add_rmsnorm_rows(y_pair, weights, x, weight, eps, total, out):
        # as add_rmsnorm_rows; top_k is a constant, so a row's top_k pair loads are in flight together,
        # and with them the norm's weights (not after the block's sum: one round of loads less)
        grid_dependency_wait()  # pdl.py: before any global read or write
        num_rows, dim = x.shape
        tid, step = cuda.threadIdx.x, cuda.blockDim.x
        values = cuda.local.array(per_thread, float32)
        scale = cuda.local.array(per_thread, float32)
        mix = cuda.local.array(top_k, float32)
        for i in range(per_thread):
            scale[i] = load_weight(weight, 0, min(tid + i * step, dim - 1))
        for row in range(cuda.blockIdx.x, num_rows, cuda.gridDim.x):
            for k in range(top_k):
                mix[k] = weights[row, k]
            for i in range(per_thread):
                d = min(tid + i * step, dim - 1)
                mixed = float32(0.0)
                for k in range(top_k):  # in order 0..A-1, as combine_ref
                    mixed += mix[k] * y_pair[row * top_k + k, d]
                values[i] = x[row, d] + mixed
            square_sum = float32(0.0)
            for i in range(per_thread):
                if tid + i * step < dim:
                    square_sum += values[i] * values[i]
            inv_rms = float32(1.0) / math.sqrt(block_sum(square_sum) / float32(dim) + eps)
            for i in range(per_thread):  # normed_store's expressions, the weights from registers
                d = tid + i * step
                if d < dim:
                    total[row, d] = values[i]
                    out[row, d] = scale[i] * (values[i] * inv_rms)

    return combine_add_rmsnorm_rows


def combine_add_rmsnorm_cuda(y_pair, weights, x, weight, eps: float, total, out, stream=0):
    """(total, out) = combine_add_rmsnorm_ref(...): y_pair (T A, D), weights (T, A), x (T, D)."""
    num_rows, dim = x.shape
    require("weights", weights, np.float32, shape=(num_rows, None))
    require("y_pair", y_pair, np.float32, shape=(num_rows * weights.shape[1], dim))
    for name, a in (("x", x), ("total", total), ("out", out)):
        require(name, a, np.float32, shape=(num_rows, dim))
    require("weight", weight, WEIGHT_DTYPES, shape=(dim,))
    if num_rows and dim:
        block = threads(ROW_THREADS)
        kernel = _combine_add_rmsnorm_kernel(storage_of(weight), int(weights.shape[1]), _per_thread(dim, block))
        kernel[blocks(num_rows), block, stream](
            y_pair, weights, x, reader_view(weight, wide=False), np.float32(eps), total, out)
    return total, out


@functools.cache
def head_rope_store(kv_storage: str, head_dim: int):
    """Device function: the rest of a (token, head) row of qkv_rope_store by its warp, from the row's values
    and the norm's weights (a lane's elements lane, lane + 32, ...) and its cos and sin in registers: a v row
    into the cache; a q or k row rmsnormed and rotated, q into q_out, k into the cache. ``is_real``: stores."""
    to_cache = STORE[kv_storage]  # k, v as the cache holds them (bf16: rounded)
    per_lane = head_dim // WARP
    half = head_dim // 2
    half_lanes = per_lane // 2  # a lane's elements i < per_lane / 2 are in the first half

    @device
    def rope_store(values, scale, cos_at, sin_at, eps, head, num_heads, num_kv_heads, t, slot, position, is_real,
                   q_out, k_cache, v_cache):
        lane = cuda.threadIdx.x % WARP
        is_q = head < num_heads
        if head >= num_heads + num_kv_heads:  # v: straight into the cache
            g = head - num_heads - num_kv_heads
            if is_real:
                for i in range(per_lane):
                    v_cache[slot, g, position, lane + i * WARP] = to_cache(values[i])
        else:
            square_sum = float32(0.0)
            for i in range(per_lane):
                square_sum += values[i] * values[i]
            square_sum = warp_sum(square_sum)
            inv_rms = float32(1.0) / math.sqrt(square_sum / float32(head_dim) + eps)
            for i in range(per_lane):
                values[i] = scale[i] * (values[i] * inv_rms)
            if is_real:
                for i in range(half_lanes):
                    d = lane + i * WARP  # d < half; its partner d + half is element i + half_lanes
                    c = cos_at[i]
                    s = sin_at[i]
                    x1 = values[i]
                    x2 = values[i + half_lanes]
                    if is_q:
                        q_out[t, head, d] = x1 * c - x2 * s
                        q_out[t, head, d + half] = x2 * c + x1 * s
                    else:
                        k_cache[slot, head - num_heads, position, d] = to_cache(x1 * c - x2 * s)
                        k_cache[slot, head - num_heads, position, d + half] = to_cache(x2 * c + x1 * s)

    return rope_store


@functools.cache
def _qkv_kernel(storage: str, head_dim: int, kv_storage: str):
    load_weight = SCALAR[storage]
    rope_store = head_rope_store(kv_storage, head_dim)
    per_lane = head_dim // WARP
    half_lanes = per_lane // 2

    @kernel
    def qkv_rope_store_rows(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, token_slot, token_pos, cos, sin,
                            q_out, k_cache, v_cache):
        # one warp per head row: rows [0, T H) are q heads, then T KVH k heads, then T KVH v heads;
        # a warp's row kind is uniform, so its reductions stay in step
        grid_dependency_wait()  # pdl.py: before any global read or write
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        num_tokens = qkv.shape[0]
        heads_per_token = num_heads + 2 * num_kv_heads
        num_rows = num_tokens * heads_per_token
        values = cuda.local.array(per_lane, float32)
        scale = cuda.local.array(per_lane, float32)
        cos_at = cuda.local.array(half_lanes, float32)
        sin_at = cuda.local.array(half_lanes, float32)
        for start in range(0, num_rows, stride):
            row = min(start + first, num_rows - 1)
            is_real = start + first < num_rows
            head = row % heads_per_token  # column block of qkv
            t = row // heads_per_token
            slot = token_slot[t]
            position = token_pos[t]
            is_q = head < num_heads
            for i in range(per_lane):  # every load of the row first (a v row does not use the norm's and rope's)
                d = lane + i * WARP
                values[i] = qkv[t, head * head_dim + d]
                scale[i] = load_weight(q_weight, 0, d) if is_q else load_weight(k_weight, 0, d)
            for i in range(half_lanes):
                cos_at[i] = cos[position, lane + i * WARP]
                sin_at[i] = sin[position, lane + i * WARP]
            rope_store(values, scale, cos_at, sin_at, eps, head, num_heads, num_kv_heads, t, slot, position, is_real,
                       q_out, k_cache, v_cache)

    return qkv_rope_store_rows


def qkv_rope_store_cuda(qkv, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, token_slot,
                        token_pos, cos, sin, k_cache, v_cache, q_out, stream=0):
    """qkv_rope_store_ref on device arrays; returns q_out (T, H, hd). hd a multiple of 64, <= 256."""
    num_tokens = qkv.shape[0]
    head_dim = q_weight.shape[0]
    require("qkv", qkv, np.float32, shape=(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim))
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        require(name, w, WEIGHT_DTYPES, shape=(head_dim,))
    require("token_slot", token_slot, np.int32, shape=(num_tokens,))
    require("token_pos", token_pos, np.int32, shape=(num_tokens,))
    require("cos", cos, np.float32, shape=(None, head_dim // 2))
    require("sin", sin, np.float32, shape=tuple(cos.shape))
    kv_storage = require_caches(k_cache, v_cache, num_kv_heads, head_dim)
    require("q_out", q_out, np.float32, shape=(num_tokens, num_heads, head_dim))
    if not can_fuse_heads(head_dim):
        raise ValueError(f"head_dim {head_dim}: the fused kernel takes multiples of 64 up to 256")
    rows = num_tokens * (num_heads + 2 * num_kv_heads)
    if rows:
        grid, block = warp_per_row(rows, HEAD_WARPS)
        kernel = _qkv_kernel(storage_of(q_weight), head_dim, kv_storage)
        kernel[grid, block, stream](
            qkv, int(num_heads), int(num_kv_heads), reader_view(q_weight, wide=False), reader_view(k_weight, wide=False),
            np.float32(eps), token_slot, token_pos, cos, sin, q_out, k_cache, v_cache)
    return q_out


def can_fuse_heads(head_dim: int) -> bool:
    return head_dim % (2 * WARP) == 0 and head_dim <= MAX_PER_LANE * WARP
