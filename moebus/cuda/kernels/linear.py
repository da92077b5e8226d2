"""Linear layer without bias: y = x @ W^T with W in the Hugging Face (out, in) layout, fp32 accumulation.

The kernel is a warp-per-output-row GEMV that handles up to ``MAX_TOKENS`` tokens per pass (the
weights row is read once for all of them); longer inputs (prefill) run as a second grid dimension of
token chunks, so blocks on the same rows run together and re-read the weights from L2. Where rows are
few for their length (the o projection, 2048 rows of 4096; a router's 32) a row's words are split
among 2 or 4 warps of a block (split-K), for more warps with loads in flight (ncu had o at 0.97 TB/s
with 24% of warps active; with the split its time in the decode graph did not measurably change,
docs/performance.md). Every output is summed in the same order
whatever the number of tokens (the split depends on the weight's shape only; lane l takes words l,
l + 32, ... of its span; then a fixed butterfly and the spans in order), so a sequence's result does
not depend on the rest of the batch."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.compat import MAX_WARPS, WARP, blocks, cuda, device, float32, int32, threads, warp_sum_many, \
    kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait, prefetch_rows
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, ceil_div, require
from moebus.cuda.kernels.loads import can_read_wide, chunk_reader, reader_view, storage_of

MAX_TOKENS = 8  # tokens per pass: per-lane accumulators live in registers
WARPS = 4  # output rows in flight per block
UNROLL = 4  # weight words each lane loads before using them: a GEMV is bound by loads in flight
# The work shape of a pass (shape_for), as measured on an H200 (2026-12-02, tools/device/decode7_1.sh,
# 48 x 32 A3B bench): 4 rows a warp with 3..8 tokens (each x word loaded then serves 4 rows) took
# batch 8 from 588 to 668 tok/s; 8 words a lane with 1..2 tokens was no faster than 4 at batch 1.
MAX_UNROLL = 4  # words a lane loads a round with one or two tokens a pass
ROWS_PER_WARP = 4  # rows a warp takes at once with 3..8 tokens a pass
# ... and with one or two (more weight bytes in flight a warp): qkv + o + lm_head in 24 layers of the
# 48 x 32 graph at batch 1 (H200, 2026-12-02, decode8_2.sh's CUPTI profile): 631 us with 1 row, 568 with
# 2, 578 with 3, 438 with 4 (9.0 us a call on average, against 13.0)
ROWS_PER_WARP_SHORT = 4
SPLIT_TARGET_WARPS = 8192  # ~62 warps per SM of an H200: rows x split below this get split further
MIN_SPAN_WORDS = WARP * UNROLL  # words of a row one warp of a split keeps at least
# pdl.py: each warp asks L2 for its first rows' weights before it waits for the kernel before it (in
# a graph with programmatic edges, their bytes arrive while that kernel ends). Off until measured.
PREFETCH_BEFORE_WAIT = False


def linear_ref(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    # x (T, K) float32, weight (N, K) stored -> (T, N) float32
    return np.asarray(x, dtype=np.float32) @ to_f32(weight).T


# -- cuda -----------------------------------------------------------------------------------------

@device
def accumulate(total, a, b, width):
    """total + a[0] b[0] + ... + a[width-1] b[width-1], added in that order: a lane's share of a
    GEMV row (this file's, the expert GEMVs' of moe_ffn.py and moe_quant.py)."""
    for c in range(width):
        total += a[c] * b[c]
    return total


@functools.cache
def _linear_kernel(storage: str, wide: bool, num_tokens: int, split: int, unroll: int, rows: int,
                   prefetch: bool = False):
    read_weight, width = chunk_reader(storage, wide)
    read_x, _ = chunk_reader("f32", wide)
    line_words = 16 if wide else 32  # 128 bytes of uint64 words (of 2-byte elements: 64 bytes)

    @kernel
    def linear_rows(x, weight, num_words, out):
        # grid: x over row groups (grid-stride, same trip count in every warp), y over token chunks;
        # a warp takes `rows` consecutive rows at once (each x word it loads serves all of them), and
        # a row's words are cut in `split` spans, one warp each, their partials added in span order
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        groups_per_block = cuda.blockDim.x // WARP // split
        part = warp % split
        first = cuda.blockIdx.x * groups_per_block + warp // split
        stride = cuda.gridDim.x * groups_per_block
        span = (num_words + split - 1) // split
        begin = part * span
        end = min(begin + span, num_words)
        total_tokens, num_rows = out.shape
        num_groups = (num_rows + rows - 1) // rows
        if prefetch:
            prefetch_rows(weight, min(first, num_groups - 1) * rows, rows, num_rows, begin, end, line_words)
        grid_dependency_wait()  # pdl.py: before any global read or write (the weights' prefetch aside)
        t0 = cuda.blockIdx.y * num_tokens
        tokens = cuda.local.array(num_tokens, int32)
        for t in range(num_tokens):  # past the end: recompute the last token, never store it
            tokens[t] = min(t0 + t, total_tokens - 1)
        acc = cuda.local.array((rows, num_tokens), float32)
        w_buf = cuda.local.array((rows, unroll, width), float32)
        x_buf = cuda.local.array(width, float32)
        partial = cuda.shared.array((MAX_WARPS, rows, num_tokens), float32)
        for start in range(0, num_groups, stride):
            group = min(start + first, num_groups - 1)
            for r in range(rows):
                for t in range(num_tokens):
                    acc[r, t] = float32(0.0)
            for base in range(begin + lane, end, WARP * unroll):
                for r in range(rows):  # every weight load of the round in flight before the first use
                    row = min(group * rows + r, num_rows - 1)
                    for u in range(unroll):
                        read_weight(weight, row, min(base + u * WARP, end - 1), w_buf[r, u])
                for u in range(unroll):  # words in the order lane, lane + 32, ...: sums as before
                    word = base + u * WARP
                    if word < end:
                        for t in range(num_tokens):
                            read_x(x, tokens[t], word, x_buf)
                            for r in range(rows):
                                acc[r, t] = accumulate(acc[r, t], x_buf, w_buf[r, u], width)
            for r in range(rows):
                warp_sum_many(acc[r], num_tokens)
            real = start + first < num_groups
            if split == 1:
                if lane == 0 and real:  # constant indices keep acc in registers
                    for r in range(rows):
                        for t in range(num_tokens):
                            if t0 + t < total_tokens and group * rows + r < num_rows:
                                out[t0 + t, group * rows + r] = acc[r, t]
            else:
                if lane == 0:
                    for r in range(rows):
                        for t in range(num_tokens):
                            partial[warp, r, t] = acc[r, t]
                cuda.syncthreads()
                if lane == 0 and part == 0 and real:
                    for r in range(rows):
                        for t in range(num_tokens):
                            total = partial[warp, r, t]
                            for s in range(1, split):
                                total += partial[warp + s, r, t]
                            if t0 + t < total_tokens and group * rows + r < num_rows:
                                out[t0 + t, group * rows + r] = total
                cuda.syncthreads()  # the partials are read before the next group overwrites them

    return linear_rows


def row_split(num_rows: int, num_words: int, warps: int) -> int:
    """Warps per output row: more where rows are few (the o projection's 2048 rows of 4096, a
    router's 32), so the launch keeps ~SPLIT_TARGET_WARPS warps with their loads in flight; each
    warp keeps at least MIN_SPAN_WORDS words. A power of two dividing the block's warps."""
    split = 1
    while (split * 2 <= warps and num_rows * split < SPLIT_TARGET_WARPS
           and num_words // (2 * split) >= MIN_SPAN_WORDS):
        split *= 2
    return split


def shape_for(num_tokens: int, span_words: int) -> tuple[int, int]:
    """(words a lane loads per round, rows a warp takes) for a pass of this many tokens over spans of
    ``span_words`` words: with one or two tokens registers allow up to MAX_UNROLL words in flight
    (never more than a span gives a lane); with more, each x word loaded (L1, 16 bytes a lane) is the
    cost, and a warp taking ROWS_PER_WARP rows shares it among them."""
    if num_tokens <= 2:
        return max(1, min(MAX_UNROLL, ceil_div(span_words, WARP))), ROWS_PER_WARP_SHORT
    return (UNROLL if ROWS_PER_WARP == 1 else max(1, UNROLL // ROWS_PER_WARP * 2)), ROWS_PER_WARP


def linear_cuda(x, weight, out, stream=0):
    """out (T, N) float32 = x (T, K) float32 @ weight (N, K) stored ^T."""
    num_tokens, dim_in = x.shape
    require("x", x, np.float32, ndim=2)
    require("weight", weight, WEIGHT_DTYPES, shape=(None, dim_in))
    require("out", out, np.float32, shape=(num_tokens, weight.shape[0]))
    num_rows = weight.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return out
    wide = can_read_wide(x) and can_read_wide(weight)
    chunk = min(num_tokens, MAX_TOKENS)
    num_words = dim_in // 4 if wide else dim_in
    block = threads(WARPS * WARP)
    split = row_split(num_rows, num_words, block // WARP)  # of the shape only: batch-invariant sums
    unroll, rows = shape_for(chunk, ceil_div(num_words, split))
    num_groups = ceil_div(num_rows, rows)
    kernel = _linear_kernel(storage_of(weight), wide, chunk, split, unroll, rows, PREFETCH_BEFORE_WAIT)
    grid = (blocks(ceil_div(num_groups, block // WARP // split)), ceil_div(num_tokens, chunk))
    kernel[grid, block, stream](reader_view(x, wide), reader_view(weight, wide), num_words, out)
    return out
