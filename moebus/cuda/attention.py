"""Attention over a per-layer KV cache, one path for prefill and decode: each new token t of a
sequence in cache slot s at position p attends to positions [lo, p] of slot s (causal; lo > 0 only
with a sliding window). GQA: query head h reads kv head h // (H / KVH).

KV cache layout per layer: k_cache, v_cache (num_slots, KVH, max_context, hd) float32."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.compat import SIMULATOR, WARP, blocks, cuda, float32, threads, warp_max, warp_sum
from moebus.cuda.launch import ceil_div, require

THREADS = 256
TILE = 32  # positions per tile: one per lane when scoring
MAX_WARPS = 4
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

@cuda.jit
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


@functools.cache
def _attention_kernel(head_dim: int, group: int, num_warps: int):
    """One block per (token, kv head): its ``group`` query heads share every K/V tile it loads.
    Positions [lo, p] go by tiles of TILE with an online softmax, so shared memory stays constant
    whatever the context. Warp w scores heads w, w + num_warps, ... (lane = position in the tile);
    threads then own (head, dim) outputs for P @ V."""
    num_threads = num_warps * WARP
    head_iters = ceil_div(group, num_warps)
    outs_per_thread = ceil_div(group * head_dim, num_threads)
    k_row = head_dim + 1  # padding: lanes reading different K rows hit different banks

    @cuda.jit
    def attention_tiles(q, k_cache, v_cache, token_slot, token_pos, scale, window, out):
        t = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        q_tile = cuda.shared.array((group, head_dim), float32)
        k_tile = cuda.shared.array((TILE, k_row), float32)
        p_tile = cuda.shared.array((group, TILE), float32)
        rescale = cuda.shared.array(group, float32)
        denominators = cuda.shared.array(group, float32)
        running_max = cuda.local.array(head_iters, float32)
        running_sum = cuda.local.array(head_iters, float32)
        acc = cuda.local.array(outs_per_thread, float32)
        slot = token_slot[t]
        pos = token_pos[t]
        lo = max(pos - window + 1, 0) if window > 0 else 0
        first_head = kv_head * group
        for e in range(tid, group * head_dim, num_threads):
            q_tile[e // head_dim, e % head_dim] = q[t, first_head + e // head_dim, e % head_dim]
        for i in range(head_iters):
            running_max[i] = NEG_INF
            running_sum[i] = float32(0.0)
        for i in range(outs_per_thread):
            acc[i] = float32(0.0)
        # every tile of the loop holds at least one position of [lo, pos], so running_max turns
        # finite at the first tile and exp(old max - new max) never sees inf - inf
        for tile in range(lo - lo % TILE, pos + 1, TILE):
            cuda.syncthreads()  # q_tile is in; the previous tile's k_tile / p_tile are consumed
            for e in range(tid, TILE * head_dim, num_threads):
                r = e // head_dim
                k_tile[r, e % head_dim] = k_cache[slot, kv_head, tile + r, e % head_dim] if tile + r <= pos else float32(0.0)
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
                        total += p_tile[j, r] * v_cache[slot, kv_head, tile + r, e % head_dim]
                    acc[i] = total
        for i in range(head_iters):
            if i * num_warps + warp < group and lane == 0:
                denominators[i * num_warps + warp] = running_sum[i]
        cuda.syncthreads()
        for i in range(outs_per_thread):
            e = tid + i * num_threads
            if e < group * head_dim:
                out[t, first_head + e // head_dim, e % head_dim] = acc[i] / denominators[e // head_dim]

    return attention_tiles


def attention_cuda(q, k_cache, v_cache, token_slot, token_pos, scale: float, window: int, out, stream=0):
    """out (T, H, hd) = attention_ref(q, k_cache, v_cache, token_slot, token_pos, scale, window).
    Every token's own position must already be in the cache (kv_store first)."""
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
    group = num_heads // num_kv_heads
    num_warps = min(group, MAX_WARPS, 2 if SIMULATOR else MAX_WARPS)
    kernel = _attention_kernel(head_dim, group, num_warps)
    kernel[(num_tokens, num_kv_heads), num_warps * WARP, stream](
        q, k_cache, v_cache, token_slot, token_pos, np.float32(scale), int(window or 0), out)
    return out
