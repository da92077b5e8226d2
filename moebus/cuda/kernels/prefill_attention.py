"""Attention of a long step on tensor cores: per sequence, per block of queries and per kv head, one
batched product S = scale Q K^T over the group's query heads (GQA: they share K and V), a masked
softmax over each row of S, and one batched product O = P V written into the heads' columns of the
output. Keys are the sequence's KV cache (float32 or bf16; the chunk's own keys are stored there first), so a chunk
attends to its earlier context too; the vision tower's images attend bidirectionally.

Precision (MOEBUS_ATTENTION_COMPUTE): "split" (default) feeds bf16 tensor cores split parts,
hi = bf16(v), lo = bf16(v - hi) (gemm.py), and contracts over three copies so that one product sums
hi.hi + hi.lo + lo.hi: q3 = [qh | qh | ql] against k3 = [kh | kl | kh] (3 hd long), and
p3 = [ph, ph, pl] against v3 = [vh, vl, vh] interleaved per key (3 L long, so any prefix of keys is
whole). "f32" runs the products on float32 without tensor cores, "tf32" on TF32 tensor cores (which
misses the fidelity bar of 1e-3 on logits: 2.2e-3 measured, docs/performance.md).

Query blocks are as long as keeps the scores within MAX_SCORE_BYTES, so an 8k-token prompt needs a
bounded scratch. References: attention.attention_ref, vision_attention.vision_attention_ref.
Shapes: T tokens, H query heads, KVH kv heads, hd head dim, C cache positions, L keys, n queries."""
from __future__ import annotations

import functools
import math
import os

import numpy as np

from moebus.cuda.kernels.compat import (SIMULATOR, bits_as_f32, block_max, block_sum, blocks, cuda, device,
                                        f32_bits, float32, kernel, threads, uint16, uint32)
from moebus.cuda.kernels.gemm import COMPUTE_32F, COMPUTE_32F_FAST_TF32, OP_N, OP_T, R_16BF, R_32F, address
from moebus.cuda.kernels.launch import require

MAX_SCORE_BYTES = 512 << 20
THREADS = 64 if SIMULATOR else 256
PRECISION = os.environ.get("MOEBUS_ATTENTION_COMPUTE", "split")
NEG_INF = float32(-np.inf)
Q_PARTS, K_PARTS = (0, 0, 1), (0, 1, 0)  # which split part each of the three copies holds


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


# -- cuda: parts ----------------------------------------------------------------------------------

@device
def _part(value, part):
    """Split part ``part`` (0: hi, 1: lo) of a float32, as bf16 bits."""
    rest = float32(value)
    rounded = 0
    for _ in range(part + 1):
        bits = f32_bits(rest)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest even (gemm.split_rows)
        rest = float32(rest - bits_as_f32(rounded << 16))
    return uint16(rounded)


@device
def _as_f32(value):
    return float32(value)


@device
def _bf16_as_f32(bits):
    return bits_as_f32(uint32(bits) << 16)


def _split3_kernel(load):
    @kernel
    def split3(src, heads_first, first_head, first_row, pattern, num_heads, num_rows, out):
        # value (b, r, d) = src[first_head + b, first_row + r, d] (heads first) or src[first_row + r,
        # first_head + b, d]; out: flat (B, R, 3, hd), copy c holding part pattern[c]. Read as rows of
        # 3 hd (q3, k3) or, the same bytes, as 3 rows of hd per key (v3).
        head_dim = src.shape[2]
        for n in range(cuda.blockIdx.x, num_heads * num_rows, cuda.gridDim.x):  # a block per row
            b, r = n // num_rows, n % num_rows
            for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
                stored = src[first_head + b, first_row + r, d] if heads_first else src[first_row + r, first_head + b, d]
                value = load(stored)
                hi, lo = _part(value, 0), _part(value, 1)
                at = n * 3 * head_dim + d
                for c in range(3):
                    out[at + c * head_dim] = hi if pattern[c] == 0 else lo

    return split3


# float32 activations or cache, or a bf16 cache (whose lo parts are then 0)
SPLIT3 = {np.dtype(np.float32): _split3_kernel(_as_f32), np.dtype(np.uint16): _split3_kernel(_bf16_as_f32)}


def split3_cuda(src, heads_first: bool, first_head: int, first_row: int, pattern, num_heads: int, num_rows: int, out,
                stream=0):
    """The three copies of num_heads x num_rows rows of src (T, H, hd) or (H, C, hd) into flat out."""
    require("src", src, tuple(SPLIT3), ndim=3, contiguous=False)
    require("out", out, np.uint16, ndim=1)
    size = num_heads * num_rows * src.shape[2]
    if 3 * size > out.shape[0]:
        raise ValueError(f"out: {out.shape[0]} elements for {3 * size}")
    if size:
        SPLIT3[src.dtype][blocks(num_heads * num_rows), threads(128), stream](
            src, bool(heads_first), int(first_head), int(first_row), pattern, int(num_heads), int(num_rows), out)
    return out


# -- cuda: softmax --------------------------------------------------------------------------------

@kernel
def masked_softmax_rows(scores, batch, num_queries, num_keys, pitch, first_pos, window, causal, split, out3):
    # one block per row of scores, flat (B, n, pitch) with L <= pitch keys a row, grid-stride;
    # probabilities in place (zeros outside the visible keys), or with ``split`` into out3, flat
    # (B, n, 3 pitch): key j's parts at 3 j ... (hi, hi, lo: Q_PARTS). Max and sum in one pass.
    tid = cuda.threadIdx.x
    for row in range(cuda.blockIdx.x, batch * num_queries, cuda.gridDim.x):
        r = row % num_queries
        at = row * pitch
        hi = first_pos + r if causal else num_keys - 1
        lo = max(hi - window + 1, 0) if causal and window > 0 else 0
        peak, total = NEG_INF, float32(0.0)
        for j in range(lo + tid, hi + 1, cuda.blockDim.x):  # an online softmax per thread
            value = scores[at + j]
            if value > peak:
                total = total * math.exp(peak - value) + float32(1.0)
                peak = value
            else:
                total += math.exp(value - peak)
        row_peak = block_max(peak)
        total = block_sum(total * math.exp(peak - row_peak) if total > 0 else float32(0.0))
        for j in range(tid, num_keys, cuda.blockDim.x):
            visible = j >= lo and j <= hi
            p = math.exp(scores[at + j] - row_peak) / total if visible else float32(0.0)
            if split:
                hi_bits = _part(p, 0)
                out3[3 * (at + j)] = hi_bits
                out3[3 * (at + j) + 1] = hi_bits
                out3[3 * (at + j) + 2] = _part(p, 1)
            else:
                scores[at + j] = p


def masked_softmax_cuda(scores, shape: tuple, first_pos: int, window: int, causal: bool, out3=None, pitch=None,
                        stream=0):
    """masked_softmax_ref on the flat ``scores`` of rows ``pitch`` (default L) apart (shape (B, n, L)),
    in place, or (out3 given, flat, rows 3 pitch apart) its split copies into out3."""
    require("scores", scores, np.float32, ndim=1)
    batch, num_queries, num_keys = (int(v) for v in shape)
    pitch = num_keys if pitch is None else int(pitch)
    split = out3 is not None
    if batch * num_queries * pitch > scores.shape[0] or split and 3 * batch * num_queries * pitch > out3.shape[0]:
        raise ValueError(f"scores or out3 shorter than {shape} at a pitch of {pitch}")
    rows = batch * num_queries
    if rows:
        grid = min(rows, 2 if SIMULATOR else 65535)
        masked_softmax_rows[grid, THREADS, stream](scores, batch, num_queries, num_keys, pitch, int(first_pos),
                                                   int(window or 0), bool(causal), split,
                                                   out3 if split else _placeholder())
    return scores if out3 is None else out3


@functools.cache
def _placeholder():
    return cuda.device_array(3, np.uint16)  # out3 when not split: never written


# -- the products ---------------------------------------------------------------------------------

class _Scratch:
    """Per-step buffers of one attention call, sized for its largest block: scores (fp32) and, when
    split, the query and probability copies."""

    def __init__(self, ops, heads: int, q_heads: int, block: int, num_keys: int, head_dim: int, split: bool):
        """``heads``: of one product (a kv head's group); ``q_heads``: of the query copies (all)."""
        self.scores = ops.empty((heads * block * _pitch(num_keys),))
        self.q3 = ops.empty((q_heads * block * 3 * head_dim,), np.uint16) if split else None
        self.p3 = ops.empty((heads * block * 3 * _pitch(num_keys),), np.uint16) if split else None


def _pitch(num_keys: int) -> int:
    return -(-num_keys // 16) * 16


def _block_rows(heads: int, num_keys: int, split: bool) -> int:
    """Queries per block: the scores (and probability copies) of ``heads`` heads in MAX_SCORE_BYTES,
    a multiple of 64 when more than 64 (aligned operands keep cuBLAS on its fastest kernels)."""
    rows = max(1, MAX_SCORE_BYTES // (heads * _pitch(num_keys) * (10 if split else 4)))
    return rows - rows % 64 if rows > 64 else rows


def _attend(ops, tc, q3, k, v, out: tuple, heads: int, num_queries: int, num_keys: int, head_dim: int, scale: float,
            first_pos: int, window: int, causal: bool, scratch: _Scratch) -> None:
    """One block of queries of ``heads`` heads. q3, k, v, out: (address, leading dim, batch stride)
    in elements: float32 rows (f32, tf32) or the split copies (q3, k3 rows of 3 hd; v3 rows of hd,
    3 per key). ``out``: float32 rows of hd."""
    split = PRECISION == "split"
    in_type, width = (R_16BF, 3 * head_dim) if split else (R_32F, head_dim)
    compute = COMPUTE_32F_FAST_TF32 if PRECISION == "tf32" else COMPUTE_32F
    s, pitch = scratch.scores, _pitch(num_keys)  # rows of S 64-byte aligned: cuBLAS's Hopper kernels need it
    tc.blas.gemm(ops.stream, OP_T, OP_N, num_keys, num_queries, width, k[0], in_type, k[1], q3[0], in_type, q3[1],
                 address(s), pitch, alpha=scale, compute=compute, batch=heads, stride_a=k[2], stride_b=q3[2],
                 stride_c=num_queries * pitch)
    p = scratch.p3 if split else s
    masked_softmax_cuda(s, (heads, num_queries, num_keys), first_pos, window, causal, out3=p if split else None,
                        pitch=pitch, stream=ops.stream)
    contraction, p_pitch = (3 * num_keys, 3 * pitch) if split else (num_keys, pitch)
    tc.blas.gemm(ops.stream, OP_N, OP_N, head_dim, num_queries, contraction, v[0], in_type, v[1], address(p), in_type,
                 p_pitch, out[0], out[1], compute=compute, batch=heads, stride_a=v[2],
                 stride_b=num_queries * p_pitch, stride_c=out[2])


def _split_keys(ops, src, heads_first: bool, first_row: int, num_heads: int, num_keys: int, head_dim: int):
    """(k3, v3) of ``num_keys`` keys of every head: k3 (heads, L, 3 hd), v3 (heads, 3 L, hd) bf16 bits."""
    k3, v3 = (ops.empty((num_heads * num_keys * 3 * head_dim,), np.uint16) for _ in range(2))
    for source, out in zip(src, (k3, v3)):
        split3_cuda(source, heads_first, 0, first_row, K_PARTS, num_heads, num_keys, out, stream=ops.stream)
    return k3, v3


def prefill_attention(ops, tc, q, k_cache, v_cache, segments, scale: float, window: int, out):
    """out (T, H, hd) = attention_ref(...) for the step's sequences ``segments``: host tuples
    (first row, cache slot, start position, length); their keys are in the caches already."""
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, context, _ = k_cache.shape
    group, split, row_ld = num_heads // num_kv_heads, PRECISION == "split", num_heads * head_dim
    if not split and k_cache.dtype != np.float32:
        raise ValueError(f"MOEBUS_ATTENTION_COMPUTE={PRECISION} reads a float32 KV cache: set kv_dtype fp32")
    for row0, slot, start, length in segments:
        num_keys = start + length
        block = min(length, _block_rows(group, num_keys, split))
        scratch = _Scratch(ops, group, num_heads, block, num_keys, head_dim, split)
        if split:
            k3, v3 = _split_keys(ops, (k_cache[slot], v_cache[slot]), True, 0, num_kv_heads, num_keys, head_dim)
        for b0 in range(0, length, block):
            n = min(block, length - b0)
            keys = start + b0 + n  # causal: the block's last query sees these
            if split:
                q3 = split3_cuda(q, False, 0, row0 + b0, Q_PARTS, num_heads, n, scratch.q3, stream=ops.stream)
            for g in range(num_kv_heads):
                first_head = ((row0 + b0) * num_heads + g * group) * head_dim * 4
                if split:
                    qa = (address(q3) + g * group * n * 3 * head_dim * 2, 3 * head_dim, n * 3 * head_dim)
                    ka = (address(k3) + g * num_keys * 3 * head_dim * 2, 3 * head_dim, 0)
                    va = (address(v3) + g * 3 * num_keys * head_dim * 2, head_dim, 0)
                else:
                    cache_at = ((slot * num_kv_heads + g) * context) * head_dim * 4
                    qa = (address(q) + first_head, row_ld, head_dim)
                    ka, va = (address(k_cache) + cache_at, head_dim, 0), (address(v_cache) + cache_at, head_dim, 0)
                _attend(ops, tc, qa, ka, va, (address(out) + first_head, row_ld, head_dim), group, n, keys, head_dim,
                        scale, start + b0, window, True, scratch)
    return out


def image_attention(ops, tc, q, k, v, num_images: int, scale: float, out):
    """out = vision_attention_ref(q, k, v, num_images, scale): each image's rows attend to each other."""
    rows, num_heads, head_dim = q.shape
    positions, split, row_ld = rows // num_images, PRECISION == "split", num_heads * head_dim
    block = min(positions, _block_rows(num_heads, positions, split))
    scratch = _Scratch(ops, num_heads, num_heads, block, positions, head_dim, split)
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
                q3 = split3_cuda(q, False, 0, image * positions + b0, Q_PARTS, num_heads, n, scratch.q3,
                                 stream=ops.stream)
                qa = (address(q3), 3 * head_dim, n * 3 * head_dim)
            _attend(ops, tc, qa, ka, va, (address(out) + rows_at, row_ld, head_dim), num_heads, n, positions,
                    head_dim, scale, 0, 0, False, scratch)
    return out
