"""Decode's qkv_rope_store and attention in one kernel (twenty-third session): the tensor-core decode attention
(attention_decode_tc.cu) built with ROPE takes the fused q | k | v projection's row and does fused.qkv_rope_store's
work for its (token, kv head) as its prologue: the group's q heads normalized and rotated into shared memory, the
token's k (normalized, rotated) and v rounded to bf16, written into the caches by the last split's block, whose warps
take the token's own key and value from shared memory. The q that qkv_rope_store wrote never leaves the block, and
its kernel (2.8 us true a layer at A3B b1) leaves the decode's chain.

``MOEBUS_ROPE_ATTENTION`` (default 1; ``0``: qkv_rope_store then the attention, as before). Where the tensor-core
kernel does not take a step (the simulator, float32 caches, a sliding window, norm weights not bf16, hd not 128),
``rope_attention_cuda`` runs the two kernels. Its reference is the two references composed."""
from __future__ import annotations

import os

import numpy as np

from moebus.cuda.kernels import attention_decode, attention_decode_tc, fused
from moebus.cuda.kernels.attention import attention_cuda, attention_ref, decode_scratch, require_caches, tc_decode
from moebus.cuda.kernels.launch import require

ENABLED = os.environ.get("MOEBUS_ROPE_ATTENTION", "1") != "0"


def rope_attention_ref(qkv, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, token_slot, token_pos,
                       cos, sin, k_cache, v_cache, scale: float, window: int = 0) -> np.ndarray:
    """qkv_rope_store_ref (the token's k and v into the caches) then attention_ref: (T, H, hd) float32."""
    q = fused.qkv_rope_store_ref(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, token_slot, token_pos, cos,
                                 sin, k_cache, v_cache)
    return attention_ref(q, k_cache, v_cache, token_slot, token_pos, scale, window)


def takes(num_heads: int, q_weight, k_weight, cos, k_cache, window: int, stream) -> bool:
    """Whether the one kernel takes this step: ENABLED, attention_decode_tc.takes (bf16 caches of hd 128, at most 8
    heads a kv head, a GPU and a stream object) and takes_rope (bf16 norm weights, a float32 table), no window."""
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    return (ENABLED and not window and attention_decode.DECODE_TC and attention_decode.WIDE_MERGE
            and num_heads % kv_heads == 0 and k_cache.dtype == np.uint16
            and attention_decode_tc.takes("bf16", head_dim, num_heads // kv_heads, stream)
            and attention_decode_tc.takes_rope(q_weight, k_weight, cos))


def rope_attention_cuda(qkv, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, token_slot, token_pos,
                        cos, sin, k_cache, v_cache, scale: float, window: int, out, scratch=None, stream=0, done=None,
                        q_out=None):
    """rope_attention_ref on device arrays into ``out`` (T, H, hd) float32: one kernel where ``takes``, else
    qkv_rope_store_cuda into ``q_out`` (T, H, hd) float32 (required then) and attention_cuda. ``scratch``,
    ``done``: attention_cuda's."""
    num_tokens = qkv.shape[0]
    head_dim = q_weight.shape[0]
    require("qkv", qkv, np.float32, shape=(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim))
    require("out", out, np.float32, shape=(num_tokens, num_heads, head_dim))
    if not takes(num_heads, q_weight, k_weight, cos, k_cache, window, stream):
        if q_out is None:
            raise ValueError("qkv_rope_store then the attention (the one kernel does not take this step) need q_out")
        fused.qkv_rope_store_cuda(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, token_slot, token_pos, cos,
                                  sin, k_cache, v_cache, q_out, stream=stream)
        return attention_cuda(q_out, k_cache, v_cache, token_slot, token_pos, scale, window, out, scratch,
                              stream=stream, done=done)
    require_caches(k_cache, v_cache, num_kv_heads, head_dim)
    for name, a in (("token_slot", token_slot), ("token_pos", token_pos)):
        require(name, a, np.int32, shape=(num_tokens,))
    require("sin", sin, np.float32, shape=tuple(cos.shape))
    if num_tokens == 0:
        return out
    context = k_cache.shape[2]
    scratch = decode_scratch(scratch, num_tokens, num_heads, head_dim, context, stream)
    merge = done is not None and attention_decode.MERGE_IN_SPLIT and done.shape[0] >= num_tokens * num_kv_heads
    return tc_decode(lambda splits, positions, counters, merged: attention_decode_tc.launch_rope(
        qkv, num_heads, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, token_slot, token_pos, scale, scratch,
        stream, splits, positions, done=counters, out=merged), merge, done, context, head_dim, token_pos, scratch, out,
        stream)
