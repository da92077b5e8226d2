"""Dense projections from FP8 weights (the attention's q/k/v/o with ``attention.dtype`` fp8): y = x @
W^T with W (R, C) held as e4m3 codes and a float32 scale per row and 128 inputs, dequantized in
registers, so a decode step reads 1 byte a weight instead of bf16's 2.

The scales are the checkpoint's 128 x 128 block grid repeated for each row of a block
(``common/fp8_dense.py``): 4 bytes per 128 codes (3% more bytes than the grid), and then q, k and v
concatenate into the fused qkv projection whatever their row counts.

Decode (up to ``MAX_TOKENS`` tokens a pass, more as a second grid dimension of token chunks): a warp
per output row, a lane loading ``unroll`` 8-byte words of the row (8 codes each, never straddling a
block: 128 is a multiple of 8) and their scales before the first use, decoding each word once for all
tokens of the pass (quant_words.decoder) and reading x 16 bytes a load, as the quantized expert GEMVs
(moe_quant.py). Many tokens (prefill): the weight is dequantized to a bf16 scratch matrix and the
bf16 path (tensor cores) runs on it (``backends/cuda.py``).

Shapes: T tokens, R rows (outputs), C columns (inputs), G = ceil(C / 128) scale columns."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from moebus.common.quant import BLOCK, e4m3_decode
from moebus.cuda.kernels.compat import (WARP, blocks, cuda, data_ptr, float32, kernel, threads, uint32, uint64,
                                       warp_sum_many)
from moebus.cuda.kernels.launch import ceil_div, require
from moebus.cuda.kernels.linear import accumulate
from moebus.cuda.kernels.loads import can_read_wide
from moebus.cuda.kernels.moe_ffn import warp_rows
from moebus.cuda.kernels.moe_quant import _x_chunk
from moebus.cuda.kernels.moe_quant_bf16 import _bf16_bits
from moebus.cuda.kernels.quant_words import decoder, e4m3_at, hardware_e4m3

MAX_TOKENS = 8  # tokens a pass: per-lane sums live in registers
WARPS = 4  # rows in flight a block
MAX_UNROLL = 8  # words a lane loads a round with 1-2 tokens (a q/k/v row of 2048 inputs: 256 words, one round)
LONG_RUN_UNROLL = 2  # ... with 3-8 tokens (as moe_quant.LONG_RUN_VALUES)
VALUES_PER_WORD = 8
WORDS_PER_BLOCK = BLOCK // VALUES_PER_WORD  # words of a row under one scale


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 dense weight on a device: ``codes`` (R, C) uint8 e4m3, ``scales`` (R, G) float32."""

    codes: object
    scales: object

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)


# -- numpy reference ----------------------------------------------------------------------------------

def fp8_rows_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 (R, C): each code's e4m3 value times its row's scale for its 128 columns."""
    cols = codes.shape[1]
    return e4m3_decode(codes) * np.repeat(np.asarray(scales, np.float32), BLOCK, axis=1)[:, :cols]


def linear_fp8_ref(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    # x (T, C) float32 -> (T, R) float32
    return np.asarray(x, np.float32) @ fp8_rows_dequantize(codes, scales).T


# -- device: the GEMV ---------------------------------------------------------------------------------

@functools.cache
def _fp8_rows_kernel(chunk: int, hardware: bool, unroll: int, exact: bool):
    """``exact``: rows are whole rounds of WARP x unroll words (a round's loads need no clamp)."""
    decode = decoder("fp8", hardware)

    @kernel
    def fp8_rows(x, codes, scales, row_words, out):
        # x (T, C) float32 as uint64; codes (R, C / 8) as uint64; scales (R, G) float32; out (T, R)
        lane, first, stride = warp_rows()
        total_tokens, num_rows = out.shape
        t0 = cuda.blockIdx.y * chunk
        run = min(chunk, total_tokens - t0)
        acc = cuda.local.array(chunk, float32)
        raw = cuda.local.array(unroll, uint64)
        factor = cuda.local.array(unroll, float32)
        w_buf = cuda.local.array((2, 4), float32)
        x_buf = cuda.local.array((2, 4), float32)
        for start in range(0, num_rows, stride):
            row = uint32(min(start + first, num_rows - 1))  # unsigned: no wraparound arithmetic a load
            for t in range(chunk):
                acc[t] = float32(0.0)
            for base in range(lane, row_words, WARP * unroll):
                for k in range(unroll):  # every load of the round in flight before the first use
                    word = uint32(base + k * WARP) if exact else uint32(min(base + k * WARP, row_words - 1))
                    raw[k] = codes[row, word]
                    factor[k] = scales[row, word // uint32(WORDS_PER_BLOCK)]
                for k in range(unroll):
                    word = base + k * WARP
                    if exact or word < row_words:
                        decode(raw[k], factor[k], float32(0.0), w_buf)  # once for the pass's tokens
                        for t in range(chunk):
                            if t < run:  # the same for the whole block: no divergence
                                for i in range(2):
                                    _x_chunk(x, uint32(t0 + t), uint64(4 * word + 2 * i), x_buf[i])
                                dot = float32(0.0)
                                for i in range(2):
                                    dot = accumulate(dot, x_buf[i], w_buf[i], 4)
                                acc[t] += factor[k] * dot
            warp_sum_many(acc, chunk)
            if lane == 0 and start + first < num_rows:  # constant indices keep the sums in registers
                for t in range(chunk):
                    if t < run:
                        out[t0 + t, row] = acc[t]

    return fp8_rows


def unroll_for(row_words: int, chunk: int) -> tuple[int, bool]:
    """(words a lane loads a round, whether rows are whole rounds): all of a row's where they fit
    with 1-2 tokens a pass; with more, LONG_RUN_UNROLL (at 8 tokens an unroll of 8 spills the sums
    to local memory, ptx_check), each word then serving several tokens."""
    unroll = max(1, min(MAX_UNROLL if chunk <= 2 else LONG_RUN_UNROLL, ceil_div(row_words, WARP)))
    return unroll, row_words % (WARP * unroll) == 0


def _check(codes, scales, cols: int) -> None:
    require("codes", codes, np.uint8, ndim=2)
    require("scales", scales, np.float32, shape=(codes.shape[0], ceil_div(codes.shape[1], BLOCK)))
    if cols % VALUES_PER_WORD:
        raise ValueError(f"an FP8 projection's inputs are read 8 codes a word: {cols} is not a multiple of 8")


def linear_fp8_cuda(x, codes, scales, out, stream=0):
    """out (T, R) float32 = x (T, C) float32 @ the FP8 weight (codes, scales) ^T; x 16-byte aligned."""
    num_tokens, cols = x.shape
    require("x", x, np.float32, ndim=2)
    _check(codes, scales, cols)
    if codes.shape[1] != cols:
        raise ValueError(f"x has {cols} columns, the weight {codes.shape[1]}")
    require("out", out, np.float32, shape=(num_tokens, codes.shape[0]))
    if not (can_read_wide(x) and data_ptr(x) % 16 == 0):
        raise ValueError("x: the FP8 GEMV reads rows of x 16 bytes a lane (C-ordered, 16-byte aligned)")
    if num_tokens == 0 or codes.shape[0] == 0:
        return out
    chunk = min(MAX_TOKENS, num_tokens)
    row_words = cols // VALUES_PER_WORD
    kernel_ = _fp8_rows_kernel(chunk, hardware_e4m3(chunk), *unroll_for(row_words, chunk))
    grid = (blocks(ceil_div(codes.shape[0], WARPS)), ceil_div(num_tokens, chunk))
    kernel_[grid, threads(WARPS * WARP), stream](x.view(np.uint64), codes.view(np.uint64), scales, row_words, out)
    return out


# -- device: to bf16, for the tensor-core path ----------------------------------------------------------

@kernel
def _to_bf16(codes, scales, out):
    # one thread an element, grid-stride; out (R, C) uint16 bf16 bits, rounded to nearest even
    rows, cols = codes.shape
    for n in range(cuda.grid(1), rows * cols, cuda.gridsize(1)):
        r, c = n // cols, n % cols
        out[r, c] = _bf16_bits(e4m3_at(uint32(codes[r, c]), 0) * scales[r, c // BLOCK])


def fp8_to_bf16_ref(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    from moebus.cuda.dtypes import f32_to_bf16

    return f32_to_bf16(fp8_rows_dequantize(codes, scales))


def fp8_to_bf16_cuda(codes, scales, out, stream=0):
    """out (R, C) uint16 = the FP8 weight as bf16 bits (what the bf16 tensor-core path reads)."""
    _check(codes, scales, codes.shape[1])
    require("out", out, np.uint16, shape=tuple(codes.shape))
    if out.size:
        _to_bf16[blocks(ceil_div(out.size, 256)), threads(256), stream](codes, scales, out)
    return out
