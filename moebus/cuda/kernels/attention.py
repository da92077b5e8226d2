"""Attention over a per-layer KV cache, one path for prefill and decode: each new token t of a
sequence in cache slot s at position p attends to positions [lo, p] of slot s (causal; lo > 0 only
with a sliding window). GQA: query head h reads kv head h // (H / KVH).

KV cache layout per layer: k_cache, v_cache (num_slots, KVH, max_context, hd), float32 or bf16
(uint16 bits, rounded to nearest even when stored: kv_cache.py's ``kv_dtype``). The decode kernel
is attention_decode.py's, or on tensor cores attention_decode_tc.py's (bf16 caches at hd 128 on a GPU,
attention_decode.DECODE_TC) with the splits merged apart, or in its last split block where a token of the cache has
few splits (TC_MERGE_IN_SPLIT, TC_MERGE_MAX_SPLITS: merges_in_split); this file holds the references, the store and
the launch."""
from __future__ import annotations

import numpy as np

from moebus.cuda.dtypes import f32_to_bf16, to_f32
from moebus.cuda.kernels import attention_decode, attention_decode_tc
from moebus.cuda.kernels.attention_decode import (MAX_SPLITS, SPLIT_POSITIONS, decode_kernel, max_splits,
                                                  merge_splits, merge_splits_serial)
from moebus.cuda.kernels.compat import blocks, cuda, device, f32_bits, kernel, threads, uint16
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import ceil_div, require

THREADS = 256
KV_STORAGE = {"bf16": np.dtype(np.uint16), "fp32": np.dtype(np.float32)}  # kv_dtype -> cache array dtype
__all__ = ["MAX_SPLITS", "SPLIT_POSITIONS", "max_splits"]


def kv_storage(cache) -> str:
    """'bf16' or 'fp32': what a KV cache array holds (by its dtype)."""
    for name, dtype in KV_STORAGE.items():
        if cache.dtype == dtype:
            return name
    raise TypeError(f"a KV cache holds bf16 (uint16 bits) or float32, not {cache.dtype}")


def as_cache_values(values, cache) -> np.ndarray:
    """float32 ``values`` as ``cache`` stores them (bf16: rounded to nearest even)."""
    return f32_to_bf16(values) if kv_storage(cache) == "bf16" else np.asarray(values, np.float32)


def kv_store_ref(k_cache, v_cache, k, v, token_slot, token_pos) -> None:
    # k, v (T, KVH, hd) float32; token_slot, token_pos (T,) int32; writes in place
    k_cache[token_slot, :, token_pos] = as_cache_values(k, k_cache)
    v_cache[token_slot, :, token_pos] = as_cache_values(v, v_cache)


def attention_ref(q, k_cache, v_cache, token_slot, token_pos, scale: float, window: int = 0) -> np.ndarray:
    # q (T, H, hd) float32 -> (T, H, hd) float32; the caches float32 or bf16 bits
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = np.empty_like(q, dtype=np.float32)
    token_slot = np.asarray(token_slot)
    token_pos = np.asarray(token_pos)
    for slot in np.unique(token_slot):
        idx = np.nonzero(token_slot == slot)[0]
        pos = token_pos[idx]
        length = int(pos.max()) + 1
        keys = np.repeat(to_f32(k_cache[slot, :, :length]), group, axis=0)  # (H, L, hd)
        values = np.repeat(to_f32(v_cache[slot, :, :length]), group, axis=0)
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


# -- cuda: the store ------------------------------------------------------------------------------

@device
def round_bf16(value):
    """bf16 bits of a float32, rounded to nearest even (dtypes.f32_to_bf16)."""
    bits = f32_bits(value)
    return uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)


@device
def keep_f32(value):
    return value


STORE = {"bf16": round_bf16, "fp32": keep_f32}  # a float32 as a cache of that kv_dtype holds it


def _kv_store_kernel(storage: str):
    store = STORE[storage]

    @kernel
    def kv_store_flat(k_cache, v_cache, k, v, token_slot, token_pos):
        grid_dependency_wait()  # pdl.py: before any global read or write
        num_tokens, num_kv_heads, head_dim = k.shape
        per_token = num_kv_heads * head_dim
        for n in range(cuda.grid(1), num_tokens * per_token, cuda.gridsize(1)):
            t = n // per_token
            g = (n % per_token) // head_dim
            d = n % head_dim
            k_cache[token_slot[t], g, token_pos[t], d] = store(k[t, g, d])
            v_cache[token_slot[t], g, token_pos[t], d] = store(v[t, g, d])

    return kv_store_flat


_KV_STORE = {name: _kv_store_kernel(name) for name in KV_STORAGE}


def require_caches(k_cache, v_cache, num_kv_heads=None, head_dim=None) -> str:
    """Checks a (k, v) cache pair; returns its kv_dtype."""
    storage = kv_storage(k_cache)
    require("k_cache", k_cache, KV_STORAGE[storage], shape=(None, num_kv_heads, None, head_dim))
    require("v_cache", v_cache, KV_STORAGE[storage], shape=tuple(k_cache.shape))
    return storage


def kv_store_cuda(k_cache, v_cache, k, v, token_slot, token_pos, stream=0) -> None:
    """kv_store_ref on device arrays (slots and positions must be in range: the stage checks them)."""
    num_tokens = k.shape[0]
    storage = require_caches(k_cache, v_cache)
    require("k", k, np.float32, shape=(None, k_cache.shape[1], k_cache.shape[3]))
    require("v", v, np.float32, shape=tuple(k.shape))
    require("token_slot", token_slot, np.int32, shape=(num_tokens,))
    require("token_pos", token_pos, np.int32, shape=(num_tokens,))
    if k.size:
        grid = blocks(ceil_div(k.size, THREADS))
        _KV_STORE[storage][grid, threads(THREADS), stream](k_cache, v_cache, k, v, token_slot, token_pos)


# -- cuda: attention ------------------------------------------------------------------------------

def attention_scratch_shape(num_tokens: int, num_heads: int, head_dim: int, max_context: int) -> tuple:
    """float32 scratch attention_cuda needs: per (token, head, split) the output, max and sum."""
    return (num_tokens, num_heads, max_splits(max_context), head_dim + 2)


def words(cache):
    """The cache as rows of 8-byte words, one row per (slot, kv head, position): the decode kernel
    reads 4 elements (bf16) or 2 (float32) per load."""
    slots, kv_heads, context, head_dim = cache.shape
    return cache.reshape(slots * kv_heads * context, head_dim).view(np.uint64)


def attention_cuda(q, k_cache, v_cache, token_slot, token_pos, scale: float, window: int, out, scratch=None,
                   stream=0, done=None):
    """out (T, H, hd) = attention_ref(q, k_cache, v_cache, token_slot, token_pos, scale, window).
    Every token's own position must already be in the cache (kv_store first). ``scratch``: a float32
    device array of attention_scratch_shape (allocated here when None). hd: a multiple of 4.
    ``done``: int32 counters at 0, at least T * KVH of them (left at 0): with one (and
    attention_decode.MERGE_IN_SPLIT; on tensor cores, TC_MERGE_IN_SPLIT too) the split kernel merges the splits
    itself, in one launch."""
    num_tokens, num_heads, head_dim = q.shape
    require("q", q, np.float32, ndim=3)
    storage = require_caches(k_cache, v_cache, head_dim=head_dim)
    require("token_slot", token_slot, np.int32, shape=(num_tokens,))
    require("token_pos", token_pos, np.int32, shape=(num_tokens,))
    require("out", out, np.float32, shape=tuple(q.shape))
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} kv heads")
    if head_dim % 4:
        raise ValueError(f"head_dim {head_dim}: the decode kernel reads whole groups of 4 elements")
    if num_tokens == 0:
        return out
    context = k_cache.shape[2]
    scratch = decode_scratch(scratch, num_tokens, num_heads, head_dim, context, stream)
    merge = done is not None and attention_decode.MERGE_IN_SPLIT and done.shape[0] >= num_tokens * num_kv_heads
    if done is not None:
        require("done", done, np.int32, ndim=1)
    window = int(window or 0)
    if (attention_decode.DECODE_TC and attention_decode.WIDE_MERGE and not window
            and attention_decode_tc.takes(storage, head_dim, num_heads // num_kv_heads, stream)):
        return tc_decode(lambda splits, positions, counters, merged: attention_decode_tc.launch(
            q, k_cache, v_cache, token_slot, token_pos, scale, scratch, stream, splits, positions, done=counters,
            out=merged), merge, done, context, head_dim, token_pos, scratch, out, stream)
    kernel, num_threads = decode_kernel(storage, head_dim, num_heads // num_kv_heads, merge)
    args = (q, words(k_cache), words(v_cache), num_kv_heads, context, token_slot, token_pos, np.float32(scale), window,
            scratch)
    grid = (num_tokens, num_kv_heads, scratch.shape[2])
    if merge:
        kernel[grid, num_threads, stream](*args, done, out)
        return out
    kernel[grid, num_threads, stream](*args)
    return _merge_apart(head_dim, token_pos, window, scratch, out, stream)


def decode_scratch(scratch, num_tokens: int, num_heads: int, head_dim: int, context: int, stream):
    """The decode's split scratch (attention_scratch_shape, float32): ``scratch`` checked, or allocated where None."""
    shape = attention_scratch_shape(num_tokens, num_heads, head_dim, context)
    if scratch is None:
        scratch = cuda.device_array(shape, np.float32, stream=stream)
    require("scratch", scratch, np.float32, shape=shape)
    return scratch


def tc_decode(launch, merge: bool, done, context: int, head_dim: int, token_pos, scratch, out, stream):
    """The tensor-core split kernel through ``launch(decode_splits, split_positions, done, out)``: given ``merge``
    (counters) and merges_in_split, it merges itself (done and out passed); else None, None and the merge apart."""
    positions = int(attention_decode.TC_SPLIT_POSITIONS)
    in_split = merge and merges_in_split(context, positions)
    launch(attention_decode.DECODE_SPLITS, positions, done if in_split else None, out if in_split else None)
    return out if in_split else _merge_apart(head_dim, token_pos, 0, scratch, out, stream, positions)


def merges_in_split(context: int, split_positions: int) -> bool:
    """Whether the tensor-core split kernel merges too (given counters): attention_decode.TC_MERGE_IN_SPLIT, and a
    token in a cache of ``context`` positions has at most TC_MERGE_MAX_SPLITS splits (and MERGE_CAP)."""
    most = min(attention_decode.DECODE_SPLITS, ceil_div(context, split_positions))
    return bool(attention_decode.TC_MERGE_IN_SPLIT) and most <= min(attention_decode.TC_MERGE_MAX_SPLITS,
                                                                     attention_decode_tc.MERGE_CAP)


def _merge_apart(head_dim: int, token_pos, window: int, scratch, out, stream, split_positions: int = 0):
    merge = merge_splits(head_dim, split_positions)
    if merge is merge_splits_serial:
        merge[blocks(ceil_div(out.size, THREADS)), threads(THREADS), stream](token_pos, window, scratch, out)
    else:
        merge[out.shape[:2], attention_decode.MERGE_THREADS, stream](token_pos, window, scratch, out)
    return out
