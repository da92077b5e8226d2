"""Attention of a long step on tensor cores: per sequence, per block of queries and per kv head, one
batched product S = scale Q K^T over the group's query heads (GQA: they share K and V), a masked
softmax over each row of S in place, and one batched product O = P V written into the heads' columns
of the output. Keys are the sequence's KV cache (the chunk's own keys are stored there first), so a
chunk attends to its earlier context too; the vision tower's images attend bidirectionally.

Query blocks are as long as keeps S within MAX_SCORE_BYTES, so an 8k-token prompt needs a bounded
scratch. The products take float32 Q, K, V as they are (compute: TF32 tensor cores, or plain fp32
with MOEBUS_ATTENTION_COMPUTE=f32). References: attention.attention_ref, vision_attention_ref.

Shapes: T tokens, H query heads, KVH kv heads, hd head dim, C cache positions, L keys, n queries."""
from __future__ import annotations

import math
import os

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR, block_max, block_sum, cuda, float32, kernel
from moebus.cuda.kernels.gemm import COMPUTE_32F, COMPUTE_32F_FAST_TF32, OP_N, OP_T, R_32F, address
from moebus.cuda.kernels.launch import require

MAX_SCORE_BYTES = 256 << 20
THREADS = 64 if SIMULATOR else 256
COMPUTE = {"tf32": COMPUTE_32F_FAST_TF32, "f32": COMPUTE_32F}[os.environ.get("MOEBUS_ATTENTION_COMPUTE", "tf32")]
NEG_INF = float32(-np.inf)


def masked_softmax_ref(scores: np.ndarray, first_pos: int, window: int, causal: bool) -> np.ndarray:
    # scores (B, n, L) float32; row r is the query at position first_pos + r: it sees keys
    # [lo, first_pos + r] when causal (lo > 0 with a sliding window), else all L
    _, num_queries, num_keys = scores.shape
    pos = first_pos + np.arange(num_queries)[:, None]
    keys = np.arange(num_keys)[None, :]
    visible = np.ones((num_queries, num_keys), bool)
    if causal:
        visible = (keys <= pos) & (keys > pos - window) if window else keys <= pos
    s = np.where(visible[None], scores, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    return (s / s.sum(axis=-1, keepdims=True)).astype(np.float32)


@kernel
def masked_softmax_rows(scores, first_pos, window, causal):
    # one block per row of scores (B, n, L), grid-stride; in place, zeros outside the visible keys
    batch, num_queries, num_keys = scores.shape
    tid = cuda.threadIdx.x
    for row in range(cuda.blockIdx.x, batch * num_queries, cuda.gridDim.x):
        b, r = row // num_queries, row % num_queries
        hi = first_pos + r if causal else num_keys - 1
        lo = max(hi - window + 1, 0) if causal and window > 0 else 0
        peak = NEG_INF
        for j in range(lo + tid, hi + 1, cuda.blockDim.x):
            peak = max(peak, scores[b, r, j])
        peak = block_max(peak)
        total = float32(0.0)
        for j in range(lo + tid, hi + 1, cuda.blockDim.x):
            total += math.exp(scores[b, r, j] - peak)
        total = block_sum(total)
        for j in range(tid, num_keys, cuda.blockDim.x):
            visible = j >= lo and j <= hi
            scores[b, r, j] = math.exp(scores[b, r, j] - peak) / total if visible else float32(0.0)


def masked_softmax_cuda(scores, first_pos: int, window: int, causal: bool, stream=0):
    require("scores", scores, np.float32, ndim=3)
    rows = scores.shape[0] * scores.shape[1]
    if rows:
        grid = min(rows, 2 if SIMULATOR else 65535)
        masked_softmax_rows[grid, THREADS, stream](scores, int(first_pos), int(window or 0), bool(causal))
    return scores


def _attend(ops, tc, q: tuple, k: tuple, v: tuple, out: tuple, batch: int, num_queries: int, num_keys: int,
            head_dim: int, scale: float, first_pos: int, window: int, causal: bool, scores) -> None:
    """One block of queries of ``batch`` heads. q, k, v, out: (address, leading dim, batch stride)
    in float32 elements, each matrix row-major (rows, head_dim) with rows ld apart."""
    s = scores[: batch * num_queries * num_keys].reshape(batch, num_queries, num_keys)
    tc.blas.gemm(ops.stream, OP_T, OP_N, num_keys, num_queries, head_dim, k[0], R_32F, k[1], q[0], R_32F, q[1],
                 address(s), num_keys, alpha=scale, compute=COMPUTE, batch=batch, stride_a=k[2], stride_b=q[2],
                 stride_c=num_queries * num_keys)
    masked_softmax_cuda(s, first_pos, window, causal, stream=ops.stream)
    tc.blas.gemm(ops.stream, OP_N, OP_N, head_dim, num_queries, num_keys, v[0], R_32F, v[1], address(s), R_32F,
                 num_keys, out[0], out[1], compute=COMPUTE, batch=batch, stride_a=v[2], stride_b=num_queries * num_keys,
                 stride_c=out[2])


def prefill_attention(ops, tc, q, k_cache, v_cache, segments, scale: float, window: int, out):
    """out (T, H, hd) = attention_ref(...) for the step's sequences ``segments``: host tuples
    (first row, cache slot, start position, length); their keys are in the caches already."""
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, context, _ = k_cache.shape
    group = num_heads // num_kv_heads
    row_ld = num_heads * head_dim
    for row0, slot, start, length in segments:
        num_keys = start + length
        block = max(1, min(length, MAX_SCORE_BYTES // (group * num_keys * 4)))
        scores = ops.empty((group * block * num_keys,))
        for b0 in range(0, length, block):
            n = min(block, length - b0)
            keys = start + b0 + n  # causal: the block's last query sees these
            for g in range(num_kv_heads):
                cache_at = ((slot * num_kv_heads + g) * context) * head_dim * 4
                first_head = ((row0 + b0) * num_heads + g * group) * head_dim * 4
                _attend(ops, tc, (address(q) + first_head, row_ld, head_dim),
                        (address(k_cache) + cache_at, head_dim, 0), (address(v_cache) + cache_at, head_dim, 0),
                        (address(out) + first_head, row_ld, head_dim), group, n, keys, head_dim, scale,
                        start + b0, window, True, scores)
    return out


def image_attention(ops, tc, q, k, v, num_images: int, scale: float, out):
    """out = vision_attention_ref(q, k, v, num_images, scale): each image's rows attend to each other."""
    rows, num_heads, head_dim = q.shape
    positions = rows // num_images
    row_ld = num_heads * head_dim
    block = max(1, min(positions, MAX_SCORE_BYTES // (num_heads * positions * 4)))
    scores = ops.empty((num_heads * block * positions,))
    for image in range(num_images):
        keys_at = image * positions * row_ld * 4
        for b0 in range(0, positions, block):
            n = min(block, positions - b0)
            rows_at = (image * positions + b0) * row_ld * 4
            _attend(ops, tc, (address(q) + rows_at, row_ld, head_dim), (address(k) + keys_at, row_ld, head_dim),
                    (address(v) + keys_at, row_ld, head_dim), (address(out) + rows_at, row_ld, head_dim),
                    num_heads, n, positions, head_dim, scale, 0, 0, False, scores)
    return out
