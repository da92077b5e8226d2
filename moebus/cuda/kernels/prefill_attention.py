"""Attention of a long step on tensor cores: per sequence, per block of queries and per kv head, one
batched product S = scale Q K^T over the group's query heads (GQA: they share K and V), a masked
softmax over each row of S, and one batched product O = P V written into the heads' columns of the
output. Keys are the sequence's KV cache (the chunk's own keys are stored there first), so a chunk
attends to its earlier context too; the vision tower's images attend bidirectionally.

Precision (MOEBUS_ATTENTION_COMPUTE): "split" (default) feeds bf16 tensor cores split parts,
hi = bf16(v), lo = bf16(v - hi) (gemm.py; attention_parts.py makes the copies):
- float32 keys (a float32 KV cache, an image's keys): three copies so that one product sums
  hi.hi + hi.lo + lo.hi: q3 = [qh | qh | ql] against k3 = [kh | kl | kh] (3 hd long), and
  p3 = [ph, ph, pl] against v3 = [vh, vl, vh] interleaved per key (3 L long, so any prefix of keys is
  whole);
- a bf16 KV cache (kv_dtype bf16): its keys and values are exact bf16, so S = K qh + K ql and
  O = V ph + V pl, two products each (the second accumulating, beta 1) straight from the cache: no
  copies of K or V, two thirds of the work.
"f32" runs the products on float32 without tensor cores, "tf32" on TF32 tensor cores (which misses
the fidelity bar of 1e-3 on logits: 2.2e-3 measured, docs/performance.md); both need float32 keys.

Where it can, the fused kernel of flash_attention.py runs instead (a bf16 KV cache, an image's
float32 rows; head dims multiples of 8 up to 128; MOEBUS_ATTENTION_FLASH=0 turns it off): the
same split products inside one kernel, no scores in memory. The rest stays here (a float32 KV cache,
the f32 and tf32 modes, other head dims, the simulator).

Query blocks are as long as keeps the scores within MAX_SCORE_BYTES, so an 8k-token prompt needs a
bounded scratch. References: attention.attention_ref, vision_attention.vision_attention_ref.
Shapes: T tokens, H query heads, KVH kv heads, hd head dim, C cache positions, L keys, n queries."""
from __future__ import annotations

import os

import numpy as np

from moebus.cuda.kernels import flash_attention
from moebus.cuda.kernels.attention_parts import (COPIES_PLANES, COPIES_TRIPLES, K3, Q2, Q3, masked_softmax_cuda,
                                                 masked_softmax_ref, split_copies_cuda)
from moebus.cuda.kernels.gemm import COMPUTE_32F, COMPUTE_32F_FAST_TF32, OP_N, OP_T, R_16BF, R_32F, address

MAX_SCORE_BYTES = 512 << 20
PRECISION = os.environ.get("MOEBUS_ATTENTION_COMPUTE", "split")
SCRATCH_BYTES_PER_SCORE = {"split3": 10, "halves": 8, "f32": 4}  # the scores, and the probabilities' parts
__all__ = ["masked_softmax_cuda", "masked_softmax_ref", "prefill_attention", "image_attention"]


def _mode(keys_dtype) -> str:
    """split3 (float32 keys), halves (bf16 keys) or f32 (f32 and tf32 products)."""
    if PRECISION != "split":
        if np.dtype(keys_dtype) != np.float32:
            raise ValueError(f"MOEBUS_ATTENTION_COMPUTE={PRECISION} reads a float32 KV cache: set kv_dtype fp32")
        return "f32"
    return "halves" if np.dtype(keys_dtype) == np.uint16 else "split3"


# -- the products ---------------------------------------------------------------------------------

class _Scratch:
    """Per-step buffers of one attention call, sized for its largest block: scores (fp32) and, when
    split, the query and probability copies (3 of each for split3, 2 for halves)."""

    def __init__(self, ops, heads: int, q_heads: int, block: int, num_keys: int, head_dim: int, mode: str):
        """``heads``: of one product (a kv head's group); ``q_heads``: of the query copies (all)."""
        self.mode, self.copies = mode, {"split3": 3, "halves": 2}.get(mode, 0)
        self.scores = ops.empty((heads * block * _pitch(num_keys),))
        self.q = ops.empty((q_heads * block * self.copies * head_dim,), np.uint16) if self.copies else None
        self.p = ops.empty((heads * block * self.copies * _pitch(num_keys),), np.uint16) if self.copies else None


def _pitch(num_keys: int) -> int:
    return -(-num_keys // 16) * 16


def _block_rows(heads: int, num_keys: int, mode: str) -> int:
    """Queries per block: the scores (and probability copies) of ``heads`` heads in MAX_SCORE_BYTES,
    a multiple of 64 when more than 64 (aligned operands keep cuBLAS on its fastest kernels)."""
    rows = max(1, MAX_SCORE_BYTES // (heads * _pitch(num_keys) * SCRATCH_BYTES_PER_SCORE[mode]))
    return rows - rows % 64 if rows > 64 else rows


def _attend(ops, tc, q, k, v, out: tuple, heads: int, num_queries: int, num_keys: int, head_dim: int, scale: float,
            first_pos: int, window: int, causal: bool, scratch: _Scratch) -> None:
    """One block of queries of ``heads`` heads. q, k, v, out: (address, leading dim, batch stride)
    in elements: float32 rows (f32, tf32), the split copies (split3: q3, k3 rows of 3 hd; v3 rows of
    hd, 3 per key) or, for halves, q2 (rows of 2 hd) against the bf16 cache's k and v rows of hd.
    ``out``: float32 rows of hd."""
    if scratch.mode == "halves":
        return _attend_halves(ops, tc, q, k, v, out, heads, num_queries, num_keys, head_dim, scale, first_pos, window,
                              causal, scratch)
    split = scratch.mode == "split3"
    in_type, width = (R_16BF, 3 * head_dim) if split else (R_32F, head_dim)
    compute = COMPUTE_32F_FAST_TF32 if PRECISION == "tf32" else COMPUTE_32F
    s, pitch = scratch.scores, _pitch(num_keys)  # rows of S 64-byte aligned: cuBLAS's Hopper kernels need it
    tc.blas.gemm(ops.stream, OP_T, OP_N, num_keys, num_queries, width, k[0], in_type, k[1], q[0], in_type, q[1],
                 address(s), pitch, alpha=scale, compute=compute, batch=heads, stride_a=k[2], stride_b=q[2],
                 stride_c=num_queries * pitch)
    p = scratch.p if split else s
    masked_softmax_cuda(s, (heads, num_queries, num_keys), first_pos, window, causal, out=p if split else None,
                        pitch=pitch, copies=COPIES_TRIPLES, stream=ops.stream)
    contraction, p_pitch = (3 * num_keys, 3 * pitch) if split else (num_keys, pitch)
    tc.blas.gemm(ops.stream, OP_N, OP_N, head_dim, num_queries, contraction, v[0], in_type, v[1], address(p), in_type,
                 p_pitch, out[0], out[1], compute=compute, batch=heads, stride_a=v[2],
                 stride_b=num_queries * p_pitch, stride_c=out[2])


def _attend_halves(ops, tc, q2, k, v, out: tuple, heads: int, num_queries: int, num_keys: int, head_dim: int,
                   scale: float, first_pos: int, window: int, causal: bool, scratch: _Scratch) -> None:
    """_attend against exact bf16 keys and values: S = scale K (qh + ql), O = V (ph + pl), the
    probabilities' parts as two planes."""
    s, pitch = scratch.scores, _pitch(num_keys)
    for part in range(2):  # q2 rows: [qh | ql]
        tc.blas.gemm(ops.stream, OP_T, OP_N, num_keys, num_queries, head_dim, k[0], R_16BF, k[1],
                     q2[0] + part * head_dim * 2, R_16BF, q2[1], address(s), pitch, alpha=scale, beta=float(part),
                     compute=COMPUTE_32F, batch=heads, stride_a=k[2], stride_b=q2[2], stride_c=num_queries * pitch)
    plane = heads * num_queries * pitch
    masked_softmax_cuda(s, (heads, num_queries, num_keys), first_pos, window, causal, out=scratch.p, pitch=pitch,
                        copies=COPIES_PLANES, stream=ops.stream)
    for part in range(2):
        tc.blas.gemm(ops.stream, OP_N, OP_N, head_dim, num_queries, num_keys, v[0], R_16BF, v[1],
                     address(scratch.p) + part * plane * 2, R_16BF, pitch, out[0], out[1], beta=float(part),
                     compute=COMPUTE_32F, batch=heads, stride_a=v[2], stride_b=num_queries * pitch, stride_c=out[2])


def _split_keys(ops, src, heads_first: bool, first_row: int, num_heads: int, num_keys: int, head_dim: int):
    """(k3, v3) of ``num_keys`` keys of every head: k3 (heads, L, 3 hd), v3 (heads, 3 L, hd) bf16 bits."""
    k3, v3 = (ops.empty((num_heads * num_keys * 3 * head_dim,), np.uint16) for _ in range(2))
    for source, out in zip(src, (k3, v3)):
        split_copies_cuda(source, heads_first, 0, first_row, K3, num_heads, num_keys, out, stream=ops.stream)
    return k3, v3


def prefill_attention(ops, tc, q, k_cache, v_cache, segments, scale: float, window: int, out):
    """out (T, H, hd) = attention_ref(...) for the step's sequences ``segments``: host tuples
    (first row, cache slot, start position, length); their keys are in the caches already."""
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, context, _ = k_cache.shape
    if _mode(k_cache.dtype) == "halves" and flash_attention.ready(head_dim, False):
        return flash_attention.flash_prefill_cuda(q, k_cache, v_cache, segments, scale, window, out, ops.stream)
    group, mode, row_ld = num_heads // num_kv_heads, _mode(k_cache.dtype), num_heads * head_dim
    cache_bytes = k_cache.dtype.itemsize
    for row0, slot, start, length in segments:
        num_keys = start + length
        block = min(length, _block_rows(group, num_keys, mode))
        scratch = _Scratch(ops, group, num_heads, block, num_keys, head_dim, mode)
        if mode == "split3":
            k3, v3 = _split_keys(ops, (k_cache[slot], v_cache[slot]), True, 0, num_kv_heads, num_keys, head_dim)
        for b0 in range(0, length, block):
            n = min(block, length - b0)
            keys = start + b0 + n  # causal: the block's last query sees these
            if scratch.copies:
                qc = split_copies_cuda(q, False, 0, row0 + b0, Q3 if mode == "split3" else Q2, num_heads, n, scratch.q,
                                       stream=ops.stream)
            for g in range(num_kv_heads):
                first_head = ((row0 + b0) * num_heads + g * group) * head_dim * 4
                cache_at = ((slot * num_kv_heads + g) * context) * head_dim * cache_bytes
                width = scratch.copies * head_dim
                qa = (address(qc) + g * group * n * width * 2, width, n * width) if scratch.copies else \
                    (address(q) + first_head, row_ld, head_dim)
                if mode == "split3":
                    ka = (address(k3) + g * num_keys * 3 * head_dim * 2, 3 * head_dim, 0)
                    va = (address(v3) + g * 3 * num_keys * head_dim * 2, head_dim, 0)
                else:  # the cache's own rows (bf16 for halves, float32 for f32)
                    ka, va = (address(k_cache) + cache_at, head_dim, 0), (address(v_cache) + cache_at, head_dim, 0)
                _attend(ops, tc, qa, ka, va, (address(out) + first_head, row_ld, head_dim), group, n, keys, head_dim,
                        scale, start + b0, window, True, scratch)
    return out


def image_attention(ops, tc, q, k, v, num_images: int, scale: float, out):
    """out = vision_attention_ref(q, k, v, num_images, scale): each image's rows attend to each other."""
    rows, num_heads, head_dim = q.shape
    positions, mode, row_ld = rows // num_images, _mode(q.dtype), num_heads * head_dim
    if mode == "split3" and flash_attention.ready(head_dim, True):
        return flash_attention.flash_images_cuda(q, k, v, num_images, scale, out, ops.stream)
    split = mode == "split3"
    block = min(positions, _block_rows(num_heads, positions, mode))
    scratch = _Scratch(ops, num_heads, num_heads, block, positions, head_dim, mode)
    for image in range(num_images):
        keys_at = image * positions * row_ld * 4
        if split:
            k3, v3 = _split_keys(ops, (k, v), False, image * positions, num_heads, positions, head_dim)
            ka = (address(k3), 3 * head_dim, positions * 3 * head_dim)
            va = (address(v3), head_dim, 3 * positions * head_dim)
        else:
            ka, va = (address(k) + keys_at, row_ld, head_dim), (address(v) + keys_at, row_ld, head_dim)
        for b0 in range(0, positions, block):
            n = min(block, positions - b0)
            rows_at = (image * positions + b0) * row_ld * 4
            qa = (address(q) + rows_at, row_ld, head_dim)
            if split:
                q3 = split_copies_cuda(q, False, 0, image * positions + b0, Q3, num_heads, n, scratch.q,
                                       stream=ops.stream)
                qa = (address(q3), 3 * head_dim, n * 3 * head_dim)
            _attend(ops, tc, qa, ka, va, (address(out) + rows_at, row_ld, head_dim), num_heads, n, positions,
                    head_dim, scale, 0, 0, False, scratch)
    return out
