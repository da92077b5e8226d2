"""Attention over a per-layer KV cache, one path for prefill and decode: each new token t of a
sequence in cache slot s at position p attends to positions [lo, p] of slot s (causal; lo > 0 only
with a sliding window). GQA: query head h reads kv head h // (H / KVH).

KV cache layout per layer: k_cache, v_cache (num_slots, KVH, max_context, hd) float32."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR, WARP, blocks, cuda, device, float32, threads, warp_max, warp_sum, kernel
from moebus.cuda.kernels.launch import ceil_div, require

THREADS = 256
TILE = 32  # positions per tile: one per lane when scoring
TILES_PER_SPLIT = 1  # a longer context is cut into splits that run as separate blocks (decode has few tokens: spread them)
MAX_SPLITS = 16  # ...at most this many per token (bounds the scratch)
MAX_WARPS = 8  # a block's warps: one per query head of the group when it has 8 (Qwen3-30B-A3B)
NEG_INF = float32(-np.inf)


def kv_store_ref(k_cache, v_cache, k, v, token_slot, token_pos) -> None:
    # k, v (T, KVH, hd) float32; token_slot, token_pos (T,) int32; writes in place
    k_cache[token_slot, :, token_pos] = k
    v_cache[token_slot, :, token_pos] = v


def attention_ref(q, k_cache, v_cache, token_slot, token_pos, scale: float, window: int = 0) -> np.ndarray:
    # q (T, H, hd) float32 -> (T, H, hd) float32
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = np.empty_like(q, dtype=np.float32)
    token_slot = np.asarray(token_slot)
    token_pos = np.asarray(token_pos)
    for slot in np.unique(token_slot):
        idx = np.nonzero(token_slot == slot)[0]
        pos = token_pos[idx]
        length = int(pos.max()) + 1
        keys = np.repeat(k_cache[slot, :, :length], group, axis=0)  # (H, L, hd)
        values = np.repeat(v_cache[slot, :, :length], group, axis=0)
        scores = np.einsum("nhd,hld->hnl", q[idx], keys).astype(np.float32) * np.float32(scale)
        kv_pos = np.arange(length)[None, :]
        lo = pos[:, None] - window + 1 if window else np.zeros_like(pos)[:, None]
        masked = (kv_pos > pos[:, None]) | (kv_pos < lo)
        scores = np.where(masked[None], -np.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[idx] = np.einsum("hnl,hld->nhd", probs.astype(np.float32), values)
    return out


# -- cuda -----------------------------------------------------------------------------------------

@kernel
def kv_store_flat(k_cache, v_cache, k, v, token_slot, token_pos):
    num_tokens, num_kv_heads, head_dim = k.shape
    per_token = num_kv_heads * head_dim
    for n in range(cuda.grid(1), num_tokens * per_token, cuda.gridsize(1)):
        t = n // per_token
        g = (n % per_token) // head_dim
        d = n % head_dim
        k_cache[token_slot[t], g, token_pos[t], d] = k[t, g, d]
        v_cache[token_slot[t], g, token_pos[t], d] = v[t, g, d]


def kv_store_cuda(k_cache, v_cache, k, v, token_slot, token_pos, stream=0) -> None:
    """kv_store_ref on device arrays (slots and positions must be in range: the stage checks them)."""
    num_tokens = k.shape[0]
    require("k_cache", k_cache, np.float32, ndim=4)
    require("v_cache", v_cache, np.float32, shape=tuple(k_cache.shape))
    require("k", k, np.float32, shape=(None, k_cache.shape[1], k_cache.shape[3]))
    require("v", v, np.float32, shape=tuple(k.shape))
    require("token_slot", token_slot, np.int32, shape=(num_tokens,))
    require("token_pos", token_pos, np.int32, shape=(num_tokens,))
    if k.size:
        grid = blocks(ceil_div(k.size, THREADS))
        kv_store_flat[grid, threads(THREADS), stream](k_cache, v_cache, k, v, token_slot, token_pos)


@device
def split_tiles(lo, pos, split):
    """Tiles [first, end) of split ``split`` of a token attending to [lo, pos], and how many splits
    the token has. A function of the token alone (never of the batch): TILES_PER_SPLIT tiles a
    split, at most MAX_SPLITS splits, the tiles spread evenly."""
    first = lo // TILE
    num_tiles = pos // TILE - first + 1
    num_splits = min(MAX_SPLITS, (num_tiles + TILES_PER_SPLIT - 1) // TILES_PER_SPLIT)
    return (first + split * num_tiles // num_splits, first + (split + 1) * num_tiles // num_splits,
            num_splits)


@functools.cache
def _attention_kernel(head_dim: int, group: int, num_warps: int):
    """One block per (token, kv head, split): the token's ``group`` query heads share every K/V tile
    the block loads, and its positions are cut into splits so that a long context is spread over
    blocks (decode has few tokens). Within a split, positions go by tiles of TILE with an online
    softmax, so shared memory stays constant whatever the context. Warp w scores heads w,
    w + num_warps, ... (lane = position in the tile); threads then own (head, dim) outputs of P @ V.
    Each split writes its unnormalised output, max and sum to ``partial`` for _merge_splits."""
    num_threads = num_warps * WARP
    head_iters = ceil_div(group, num_warps)
    outs_per_thread = ceil_div(group * head_dim, num_threads)
    k_row = head_dim + 1  # padding: lanes reading different K rows hit different banks
    tile_loads = ceil_div(TILE * head_dim, num_threads)

    @kernel
    def attention_split(q, k_cache, v_cache, token_slot, token_pos, scale, window, partial):
        t = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        split = cuda.blockIdx.z
        pos = token_pos[t]
        lo = max(pos - window + 1, 0) if window > 0 else 0
        first_tile, end_tile, num_splits = split_tiles(lo, pos, split)
        if split >= num_splits:
            return  # the whole block
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        q_tile = cuda.shared.array((group, head_dim), float32)
        k_tile = cuda.shared.array((TILE, k_row), float32)
        v_tile = cuda.shared.array((TILE, head_dim), float32)
        p_tile = cuda.shared.array((group, TILE), float32)
        rescale = cuda.shared.array(group, float32)
        running_max = cuda.local.array(head_iters, float32)
        running_sum = cuda.local.array(head_iters, float32)
        acc = cuda.local.array(outs_per_thread, float32)
        slot = token_slot[t]
        first_head = kv_head * group
        for e in range(tid, group * head_dim, num_threads):
            q_tile[e // head_dim, e % head_dim] = q[t, first_head + e // head_dim, e % head_dim]
        for i in range(head_iters):
            running_max[i] = NEG_INF
            running_sum[i] = float32(0.0)
        for i in range(outs_per_thread):
            acc[i] = float32(0.0)
        # every tile holds at least one position of [lo, pos], so running_max turns finite at the
        # first tile and exp(old max - new max) never sees inf - inf
        for tile_index in range(first_tile, end_tile):
            tile = tile_index * TILE
            cuda.syncthreads()  # q_tile is in; the previous tile's k_tile / p_tile are consumed
            for i in range(tile_loads):  # a constant trip count: the loads are issued back to back
                # K and V of the tile in one coalesced pass; rows past pos are zero: V there may be
                # stale, and 0 * nan is nan
                e = tid + i * num_threads
                r = min(e // head_dim, TILE - 1)
                inside = tile + r <= pos and e < TILE * head_dim
                if e < TILE * head_dim:
                    k_tile[r, e % head_dim] = k_cache[slot, kv_head, tile + r, e % head_dim] if inside else float32(0.0)
                    v_tile[r, e % head_dim] = v_cache[slot, kv_head, tile + r, e % head_dim] if inside else float32(0.0)
            cuda.syncthreads()
            valid = lo <= tile + lane <= pos
            for i in range(head_iters):
                j = min(i * num_warps + warp, group - 1)  # a warp past the last head repeats it, unsaved
                score = float32(0.0)
                for d in range(head_dim):
                    score += q_tile[j, d] * k_tile[lane, d]
                score = score * scale if valid else NEG_INF
                new_max = max(running_max[i], warp_max(score))
                p = math.exp(score - new_max) if valid else float32(0.0)
                alpha = math.exp(running_max[i] - new_max)
                running_sum[i] = running_sum[i] * alpha + warp_sum(p)
                running_max[i] = new_max
                if i * num_warps + warp < group:
                    p_tile[j, lane] = p
                    if lane == 0:
                        rescale[j] = alpha
            cuda.syncthreads()
            r_lo = max(lo - tile, 0)  # skip masked rows: V there may be stale, and 0 * nan is nan
            r_hi = min(pos + 1 - tile, TILE)
            for i in range(outs_per_thread):
                e = tid + i * num_threads
                if e < group * head_dim:
                    j = e // head_dim
                    total = acc[i] * rescale[j]
                    for r in range(r_lo, r_hi):
                        total += p_tile[j, r] * v_tile[r, e % head_dim]
                    acc[i] = total
        for i in range(head_iters):
            j = i * num_warps + warp
            if j < group and lane == 0:
                partial[t, first_head + j, split, head_dim] = running_max[i]
                partial[t, first_head + j, split, head_dim + 1] = running_sum[i]
        for i in range(outs_per_thread):
            e = tid + i * num_threads
            if e < group * head_dim:
                partial[t, first_head + e // head_dim, split, e % head_dim] = acc[i]

    return attention_split


@kernel
def merge_splits(token_pos, window, partial, out):
    # one thread per output (t, h, d): splits combined in order, so the result is deterministic
    num_tokens, num_heads, head_dim = out.shape
    for n in range(cuda.grid(1), num_tokens * num_heads * head_dim, cuda.gridsize(1)):
        t = n // (num_heads * head_dim)
        h = (n // head_dim) % num_heads
        d = n % head_dim
        pos = token_pos[t]
        lo = max(pos - window + 1, 0) if window > 0 else 0
        num_splits = split_tiles(lo, pos, 0)[2]
        peak = NEG_INF
        for s in range(num_splits):
            peak = max(peak, partial[t, h, s, head_dim])
        total = float32(0.0)
        value = float32(0.0)
        for s in range(num_splits):
            weight = math.exp(partial[t, h, s, head_dim] - peak)
            total += partial[t, h, s, head_dim + 1] * weight
            value += partial[t, h, s, d] * weight
        out[t, h, d] = value / total


def max_splits(max_context: int) -> int:
    """Splits a token can have in a cache of ``max_context`` positions."""
    return min(MAX_SPLITS, ceil_div(ceil_div(max_context, TILE), TILES_PER_SPLIT))


def attention_scratch_shape(num_tokens: int, num_heads: int, head_dim: int, max_context: int) -> tuple:
    """float32 scratch attention_cuda needs: per (token, head, split) the output, max and sum."""
    return (num_tokens, num_heads, max_splits(max_context), head_dim + 2)


def attention_cuda(q, k_cache, v_cache, token_slot, token_pos, scale: float, window: int, out, scratch=None,
                   stream=0):
    """out (T, H, hd) = attention_ref(q, k_cache, v_cache, token_slot, token_pos, scale, window).
    Every token's own position must already be in the cache (kv_store first). ``scratch``: a float32
    device array of attention_scratch_shape (allocated here when None)."""
    num_tokens, num_heads, head_dim = q.shape
    require("q", q, np.float32, ndim=3)
    require("k_cache", k_cache, np.float32, shape=(None, None, None, head_dim))
    require("v_cache", v_cache, np.float32, shape=tuple(k_cache.shape))
    require("token_slot", token_slot, np.int32, shape=(num_tokens,))
    require("token_pos", token_pos, np.int32, shape=(num_tokens,))
    require("out", out, np.float32, shape=tuple(q.shape))
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} kv heads")
    if num_tokens == 0:
        return out
    scratch_shape = attention_scratch_shape(num_tokens, num_heads, head_dim, k_cache.shape[2])
    if scratch is None:
        scratch = cuda.device_array(scratch_shape, np.float32, stream=stream)
    require("scratch", scratch, np.float32, shape=scratch_shape)
    group = num_heads // num_kv_heads
    num_warps = min(group, MAX_WARPS, 2 if SIMULATOR else MAX_WARPS)
    kernel = _attention_kernel(head_dim, group, num_warps)
    window = int(window or 0)
    kernel[(num_tokens, num_kv_heads, scratch_shape[2]), num_warps * WARP, stream](
        q, k_cache, v_cache, token_slot, token_pos, np.float32(scale), window, scratch)
    merge_splits[blocks(ceil_div(out.size, THREADS)), threads(THREADS), stream](token_pos, window, scratch, out)
    return out
