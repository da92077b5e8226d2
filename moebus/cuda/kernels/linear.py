"""Linear layer without bias: y = x @ W^T with W in the Hugging Face (out, in) layout, fp32 accumulation.

The kernel is a warp-per-output-row GEMV that handles up to ``MAX_TOKENS`` tokens per pass (the
weights row is read once for all of them); longer inputs (prefill) run as a second grid dimension of
token chunks, so blocks on the same rows run together and re-read the weights from L2. Every output
is summed in the same order whatever the number of tokens (lane l takes words l, l + 32, ...; then a
fixed butterfly), so a sequence's result does not depend on the rest of the batch."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.compat import WARP, cuda, float32, int32, warp_sum_many, kernel
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, ceil_div, require, warp_per_row
from moebus.cuda.kernels.loads import can_read_wide, chunk_reader, reader_view, storage_of

MAX_TOKENS = 8  # tokens per pass: per-lane accumulators live in registers
WARPS = 4  # output rows in flight per block
UNROLL = 4  # weight words each lane loads before using them: a GEMV is bound by loads in flight


def linear_ref(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    # x (T, K) float32, weight (N, K) stored -> (T, N) float32
    return np.asarray(x, dtype=np.float32) @ to_f32(weight).T


# -- cuda -----------------------------------------------------------------------------------------

@functools.cache
def _linear_kernel(storage: str, wide: bool, num_tokens: int):
    read_weight, width = chunk_reader(storage, wide)
    read_x, _ = chunk_reader("f32", wide)

    @kernel
    def linear_rows(x, weight, num_words, out):
        # grid: x over row groups (grid-stride, same trip count in every warp), y over token chunks
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        total_tokens, num_rows = out.shape
        t0 = cuda.blockIdx.y * num_tokens
        tokens = cuda.local.array(num_tokens, int32)
        for t in range(num_tokens):  # past the end: recompute the last token, never store it
            tokens[t] = min(t0 + t, total_tokens - 1)
        acc = cuda.local.array(num_tokens, float32)
        w_buf = cuda.local.array((UNROLL, width), float32)
        x_buf = cuda.local.array(width, float32)
        for start in range(0, num_rows, stride):
            row = min(start + first, num_rows - 1)
            for t in range(num_tokens):
                acc[t] = float32(0.0)
            for base in range(lane, num_words, WARP * UNROLL):
                for u in range(UNROLL):  # UNROLL weight loads in flight before the first use
                    read_weight(weight, row, min(base + u * WARP, num_words - 1), w_buf[u])
                for u in range(UNROLL):  # words in the order lane, lane + 32, ...: sums as before
                    word = base + u * WARP
                    if word < num_words:
                        for t in range(num_tokens):
                            read_x(x, tokens[t], word, x_buf)
                            total = acc[t]
                            for c in range(width):
                                total += x_buf[c] * w_buf[u, c]
                            acc[t] = total
            warp_sum_many(acc, num_tokens)
            if lane == 0 and start + first < num_rows:  # constant indices keep acc in registers
                for t in range(num_tokens):
                    if t0 + t < total_tokens:
                        out[t0 + t, row] = acc[t]

    return linear_rows


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
    kernel = _linear_kernel(storage_of(weight), wide, chunk)
    row_blocks, block = warp_per_row(num_rows, WARPS)
    grid = (row_blocks, ceil_div(num_tokens, chunk))
    num_words = dim_in // 4 if wide else dim_in
    kernel[grid, block, stream](reader_view(x, wide), reader_view(weight, wide), num_words, out)
    return out
