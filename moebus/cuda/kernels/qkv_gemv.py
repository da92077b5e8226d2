"""Decode's q | k | v projection for one token with fused.qkv_rope_store's per-head work as its tail, in one
launch where two took a kernel boundary each (``ENABLED``; off until measured on the GPU).

The GEMV is linear.py's for one token, with linear_cuda's work shape (row_split, shape_for) and its sums in
the same order, so each projected value has linear_cuda's bits. A block takes ``rows_per_block`` consecutive
rows, all of one head (head_dim a multiple of them); after storing them into ``qkv`` it counts itself on its
head's counter (routing.is_last_of: a fence, then an atomic), and the last block of a head reads the head's
row back through L2 and does what qkv_rope_store_rows does for it with one warp: the head's rmsnorm and RoPE
(q, k), k and v into the caches, with the same expressions (fused.head_rope_store), so q and the caches get
qkv_rope_store's bits too. The counters (one a head, ``done``) are reset by each head's last block, so a
captured graph replays the launch."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.attention import require_caches
from moebus.cuda.kernels.compat import MAX_WARPS, WARP, cuda, float32, kernel, threads, warp_sum_many
from moebus.cuda.kernels.fused import can_fuse_heads, head_rope_store
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, ceil_div, require
from moebus.cuda.kernels.linear import WARPS, accumulate, row_split, shape_for
from moebus.cuda.kernels.loads import SCALAR, WORD, can_read_wide, chunk_reader, reader_view, storage_of
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.routing import is_last_of

ENABLED = False  # the backend's linear_qkv_rope_store takes this kernel where it applies (work_shape)
MAX_HEADS = 256  # counters the backend keeps (one a q, k or v head of one token)


def work_shape(num_rows: int, num_words: int, head_dim: int, block: int) -> tuple[int, int, int] | None:
    """(split, unroll, rows) of linear_cuda's one-token pass over these rows, or None where a block's rows
    would straddle two heads."""
    split = row_split(num_rows, num_words, block // WARP)
    unroll, rows = shape_for(1, ceil_div(num_words, split))
    rows_per_block = block // WARP // split * rows
    return (split, unroll, rows) if head_dim % rows_per_block == 0 else None


@functools.cache
def _kernel(storage: str, norm_storage: str, kv_storage: str, head_dim: int, split: int, unroll: int, rows: int):
    read_weight, width = chunk_reader(storage, True)
    read_x, _ = chunk_reader("f32", True)
    load_weight = SCALAR[norm_storage]
    rope_store = head_rope_store(kv_storage, head_dim)
    per_lane = head_dim // WARP
    half_lanes = per_lane // 2

    @kernel
    def qkv_gemv_rope(x, weight, num_words, num_heads, num_kv_heads, q_weight, k_weight, eps, token_slot, token_pos,
                      cos, sin, done, qkv, q_out, k_cache, v_cache):
        grid_dependency_wait()  # pdl.py: before any global read or write
        lane, warp = cuda.threadIdx.x % WARP, cuda.threadIdx.x // WARP
        groups_per_block = cuda.blockDim.x // WARP // split
        part = warp % split
        group = cuda.blockIdx.x * groups_per_block + warp // split  # the grid covers every group once
        span = (num_words + split - 1) // split
        begin = part * span
        end = min(begin + span, num_words)
        num_rows = qkv.shape[1]
        slot = token_slot[0]  # for the tail: its loads off the tail's critical path
        position = token_pos[0]
        # 1. linear_rows for one token: the same loads, sums and order
        acc = cuda.local.array(rows, float32)
        w_buf = cuda.local.array((rows, unroll, width), float32)
        x_buf = cuda.local.array(width, float32)
        partial = cuda.shared.array((MAX_WARPS, rows), float32)
        for r in range(rows):
            acc[r] = float32(0.0)
        for base in range(begin + lane, end, WARP * unroll):
            for r in range(rows):
                row = min(group * rows + r, num_rows - 1)
                for u in range(unroll):
                    read_weight(weight, row, min(base + u * WARP, end - 1), w_buf[r, u])
            for u in range(unroll):
                word = base + u * WARP
                if word < end:
                    read_x(x, 0, word, x_buf)
                    for r in range(rows):
                        acc[r] = accumulate(acc[r], x_buf, w_buf[r, u], width)
        warp_sum_many(acc, rows)
        if split == 1:
            if lane == 0:
                for r in range(rows):
                    if group * rows + r < num_rows:
                        qkv[0, group * rows + r] = acc[r]
        else:
            if lane == 0:
                for r in range(rows):
                    partial[warp, r] = acc[r]
            cuda.syncthreads()
            if lane == 0 and part == 0:
                for r in range(rows):
                    total = partial[warp, r]
                    for s in range(1, split):
                        total += partial[warp + s, r]
                    if group * rows + r < num_rows:
                        qkv[0, group * rows + r] = total
        # 2. the head's last block: qkv_rope_store_rows for its row (the norm's weights, cos and sin loaded by
        # every block's warp 0 before the count, so the tail waits only for the row's values)
        rows_per_block = groups_per_block * rows
        head = cuda.blockIdx.x * rows_per_block // head_dim
        is_q = head < num_heads
        values = cuda.local.array(per_lane, float32)
        scale = cuda.local.array(per_lane, float32)
        cos_at = cuda.local.array(half_lanes, float32)
        sin_at = cuda.local.array(half_lanes, float32)
        if warp == 0:
            for i in range(per_lane):
                d = lane + i * WARP
                scale[i] = load_weight(q_weight, 0, d) if is_q else load_weight(k_weight, 0, d)
            for i in range(half_lanes):
                cos_at[i] = cos[position, lane + i * WARP]
                sin_at[i] = sin[position, lane + i * WARP]
        if not is_last_of(done, head, head_dim // rows_per_block):
            return  # the whole block
        if cuda.threadIdx.x == 0:
            done[head] = 0  # for the next launch (a graph replays this one); every block of the head has counted
        if warp != 0:
            return
        for i in range(per_lane):  # other blocks wrote the row: through L2
            values[i] = cuda.atomic.add(qkv, (0, head * head_dim + lane + i * WARP), float32(0.0))
        rope_store(values, scale, cos_at, sin_at, eps, head, num_heads, num_kv_heads, 0, slot, position, True,
                   q_out, k_cache, v_cache)

    return qkv_gemv_rope


def qkv_gemv_rope_cuda(x, weight, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, token_slot,
                       token_pos, cos, sin, k_cache, v_cache, done, qkv, q_out, stream=0) -> bool:
    """qkv = x @ weight^T into ``qkv`` (1, (H + 2 KVH) hd) and qkv_rope_store_ref's work on it into q_out
    (1, H, hd) and the caches, for one token; ``done``: (>= H + 2 KVH,) int32 zeros between launches.
    False (nothing launched) where the kernel does not apply: more tokens, narrow reads, a head not a
    whole number of blocks."""
    num_tokens, dim = x.shape
    head_dim = q_weight.shape[0]
    heads = num_heads + 2 * num_kv_heads
    if num_tokens != 1 or storage_of(weight) not in WORD or not can_fuse_heads(head_dim) or heads > done.shape[0] \
            or not all(can_read_wide(a) for a in (x, weight)):
        return False
    block = threads(WARPS * WARP)
    shape = work_shape(heads * head_dim, dim // 4, head_dim, block)
    if shape is None:
        return False
    require("weight", weight, WEIGHT_DTYPES, shape=(heads * head_dim, dim))
    require("qkv", qkv, np.float32, shape=(1, heads * head_dim))
    require("q_out", q_out, np.float32, shape=(1, num_heads, head_dim))
    require("token_slot", token_slot, np.int32, shape=(1,))
    require("token_pos", token_pos, np.int32, shape=(1,))
    require("done", done, np.int32, ndim=1)
    kv_storage = require_caches(k_cache, v_cache, num_kv_heads, head_dim)
    split, unroll, rows = shape
    kernel = _kernel(storage_of(weight), storage_of(q_weight), kv_storage, head_dim, split, unroll, rows)
    grid = ceil_div(heads * head_dim, block // WARP // split * rows)
    kernel[grid, block, stream](
        reader_view(x, True), reader_view(weight, True), dim // 4, int(num_heads), int(num_kv_heads),
        reader_view(q_weight, wide=False), reader_view(k_weight, wide=False), np.float32(eps), token_slot, token_pos,
        cos, sin, done, qkv, q_out, k_cache, v_cache)
    return True
