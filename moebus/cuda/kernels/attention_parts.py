"""The element-wise kernels around prefill_attention.py's products: float32 values as copies of their
bf16 split parts (hi = bf16(v), lo = bf16(v - hi)) for bf16 tensor cores, and the masked softmax of
a block of scores, written in place or as the parts of the probabilities.

- ``split_copies``: rows of queries (T, H, hd), keys / values of a float32 or bf16 KV cache
  (H, C, hd) or of an image (T, H, hd), as ``len(pattern)`` copies of hd each per row, copy c holding
  part pattern[c] (Q3 = hi, hi, lo against K3 = hi, lo, hi; Q2 = hi, lo against a bf16 cache's
  exact keys, read twice).
- ``masked_softmax``: causal (with a sliding window) or bidirectional rows, probabilities in place,
  as interleaved triples (hi, hi, lo) per key, or as two planes (hi, then lo)."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import (SIMULATOR, WARP, bits_as_f32, blocks, cuda, device, f32_bits, float32, kernel,
                                        threads, uint16, uint32, warp_max, warp_sum)
from moebus.cuda.kernels.launch import require

THREADS = 64 if SIMULATOR else 256
NEG_INF = float32(-np.inf)
LOG2E = float32(1.4426950408889634)
Q3, K3 = (0, 0, 1), (0, 1, 0)  # three copies: hi.hi + hi.lo + lo.hi in one contraction
Q2 = (0, 1)  # two copies (hi, lo) against exact bf16 keys
COPIES_IN_PLACE, COPIES_TRIPLES, COPIES_PLANES = 0, 3, 2  # masked_softmax's outputs


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


# -- parts ----------------------------------------------------------------------------------------

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


def _split_kernel(load):
    @kernel
    def split_copies(src, heads_first, first_head, first_row, pattern, num_heads, num_rows, out):
        # value (b, r, d) = src[first_head + b, first_row + r, d] (heads first) or src[first_row + r,
        # first_head + b, d]; out: flat (B, R, copies, hd), copy c holding part pattern[c]. Read as
        # rows of copies x hd (queries, keys) or, the same bytes, as rows of hd, copies per key (values).
        head_dim = src.shape[2]
        copies = len(pattern)
        for n in range(cuda.blockIdx.x, num_heads * num_rows, cuda.gridDim.x):  # a block per row
            b, r = n // num_rows, n % num_rows
            for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
                stored = src[first_head + b, first_row + r, d] if heads_first else src[first_row + r, first_head + b, d]
                value = load(stored)
                hi, lo = _part(value, 0), _part(value, 1)
                at = n * copies * head_dim + d
                for c in range(copies):
                    out[at + c * head_dim] = hi if pattern[c] == 0 else lo

    return split_copies


# float32 activations or cache, or a bf16 cache (whose lo parts are then 0)
SPLIT = {np.dtype(np.float32): _split_kernel(_as_f32), np.dtype(np.uint16): _split_kernel(_bf16_as_f32)}


def split_copies_cuda(src, heads_first: bool, first_head: int, first_row: int, pattern, num_heads: int,
                      num_rows: int, out, stream=0):
    """The copies (``pattern``: Q3, K3 or Q2) of num_heads x num_rows rows of src (T, H, hd) or
    (H, C, hd) into flat out."""
    require("src", src, tuple(SPLIT), ndim=3, contiguous=False)
    require("out", out, np.uint16, ndim=1)
    size = num_heads * num_rows * src.shape[2]
    if len(pattern) * size > out.shape[0]:
        raise ValueError(f"out: {out.shape[0]} elements for {len(pattern) * size}")
    if size:
        SPLIT[src.dtype][blocks(num_heads * num_rows), threads(128), stream](
            src, bool(heads_first), int(first_head), int(first_row), tuple(int(p) for p in pattern), int(num_heads),
            int(num_rows), out)
    return out


# -- softmax --------------------------------------------------------------------------------------

@kernel
def masked_softmax_rows(scores, batch, num_queries, num_keys, pitch, first_pos, window, causal, copies, out):
    # one warp per row of scores, flat (B, n, pitch) with L <= pitch keys a row, grid-stride (no block
    # barrier: the max and the sum are warp shuffles); probabilities in place (zeros outside the
    # visible keys), or into ``out`` (copies 3: flat (B, n, 3 pitch), key j's parts at 3 j ...: hi, hi,
    # lo; copies 2: two planes of (B, n, pitch), the hi parts then the lo parts). Max and sum in one
    # pass, in base 2 (exp2 of log2(e) x: one ex2 per element); outside a causal row's keys nothing is read.
    lane = cuda.threadIdx.x % WARP
    warps_per_block = cuda.blockDim.x // WARP
    plane = batch * num_queries * pitch
    for row in range(cuda.blockIdx.x * warps_per_block + cuda.threadIdx.x // WARP, batch * num_queries,
                     cuda.gridDim.x * warps_per_block):
        r = row % num_queries
        at = row * pitch
        hi = first_pos + r if causal else num_keys - 1
        lo = max(hi - window + 1, 0) if causal and window > 0 else 0
        peak, total = NEG_INF, float32(0.0)
        for j in range(lo + lane, hi + 1, WARP):  # an online softmax per lane
            value = scores[at + j] * LOG2E
            if value > peak:
                total = total * math.exp2(peak - value) + float32(1.0)
                peak = value
            else:
                total += math.exp2(value - peak)
        row_peak = warp_max(peak)
        total = warp_sum(total * math.exp2(peak - row_peak) if total > 0 else float32(0.0))
        inverse = float32(1.0) / total
        for j in range(lane, num_keys, WARP):
            p = math.exp2(scores[at + j] * LOG2E - row_peak) * inverse if j >= lo and j <= hi else float32(0.0)
            if copies == COPIES_TRIPLES:
                hi_bits = _part(p, 0)
                out[3 * (at + j)] = hi_bits
                out[3 * (at + j) + 1] = hi_bits
                out[3 * (at + j) + 2] = _part(p, 1)
            elif copies == COPIES_PLANES:
                out[at + j] = _part(p, 0)
                out[plane + at + j] = _part(p, 1)
            else:
                scores[at + j] = p


def masked_softmax_cuda(scores, shape: tuple, first_pos: int, window: int, causal: bool, out=None, pitch=None,
                        copies: int = COPIES_TRIPLES, stream=0):
    """masked_softmax_ref on the flat ``scores`` of rows ``pitch`` (default L) apart (shape (B, n, L)),
    in place, or (``out`` given: flat uint16) its split parts into out, as ``copies`` says."""
    require("scores", scores, np.float32, ndim=1)
    batch, num_queries, num_keys = (int(v) for v in shape)
    pitch = num_keys if pitch is None else int(pitch)
    copies = COPIES_IN_PLACE if out is None else int(copies)
    if copies not in (COPIES_IN_PLACE, COPIES_TRIPLES, COPIES_PLANES):
        raise ValueError(f"copies {copies}: 2 (planes) or 3 (triples)")
    if batch * num_queries * pitch > scores.shape[0] or copies and copies * batch * num_queries * pitch > out.shape[0]:
        raise ValueError(f"scores or out shorter than {shape} at a pitch of {pitch}")
    rows = batch * num_queries
    if rows:
        grid = min(-(-rows // (THREADS // WARP)), 2 if SIMULATOR else 65535)
        masked_softmax_rows[grid, THREADS, stream](scores, batch, num_queries, num_keys, pitch, int(first_pos),
                                                   int(window or 0), bool(causal), copies,
                                                   _placeholder() if out is None else out)
    return scores if out is None else out


@functools.cache
def _placeholder():
    return cuda.device_array(3, np.uint16)  # out when in place: never written
