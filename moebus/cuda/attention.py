"""Attention over a per-layer KV cache, one path for prefill and decode: each new token t of a
sequence in cache slot s at position p attends to positions [lo, p] of slot s (causal; lo > 0 only
with a sliding window). GQA: query head h reads kv head h // (H / KVH).

KV cache layout per layer: k_cache, v_cache (num_slots, KVH, max_context, hd) float32."""
from __future__ import annotations

import numpy as np


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
