"""Dense projections from FP8 weights (the attention's q/k/v/o with ``attention.dtype`` fp8, the lm_head
with ``lm_head.dtype`` fp8): y = x @ W^T with W (R, C) held as e4m3 codes and a float32 scale per row
and 128 inputs, dequantized in registers, so a decode step reads 1 byte a weight instead of bf16's 2.

The scales are the checkpoint's 128 x 128 block grid repeated for each row of a block
(``common/fp8_dense.py``): 4 bytes per 128 codes (3% more bytes than the grid), and then q, k and v
concatenate into the fused qkv projection whatever their row counts.

Decode (up to ``MAX_TOKENS`` tokens a pass, more as a second grid dimension of token chunks): a warp
per ``rows_for`` output rows, a lane loading ``unroll`` 8-byte words of each row (8 codes each, never
straddling a block: 128 is a multiple of 8) and their scales before the first use, decoding each word
once for all tokens of the pass (quant_words.decoder) and reading x 16 bytes a load, as the quantized expert GEMVs
(moe_quant.py). Many tokens (prefill): the weight is dequantized to bf16 scratch, a bounded slice of
rows at a time, and the bf16 path (tensor cores) runs on each slice (``linear_quant_slices.py``).

Shapes: T tokens, R rows (outputs), C columns (inputs), G = ceil(C / 128) scale columns."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from moebus.common.quant import BLOCK, e4m3_decode
from moebus.cuda.kernels.compat import (WARP, bits_as_f32, blocks, cuda, data_ptr, device, f32_bits, float32, kernel,
                                       threads, uint32, uint64, warp_sum_many)
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import ceil_div, require
from moebus.cuda.kernels.linear import accumulate
from moebus.cuda.kernels.loads import can_read_wide
from moebus.cuda.kernels.moe_ffn import warp_rows
from moebus.cuda.kernels import linear_quant_fp8, linear_quant_mma
from moebus.cuda.kernels.moe_quant import _x_chunk
from moebus.cuda.kernels.moe_quant_bf16 import _bf16_bits
from moebus.cuda.kernels.quant_words import HARDWARE_E4M3_MIN_RUN, decoder, e4m3_at, hardware_e4m3

MAX_TOKENS = 8  # tokens a pass: per-lane sums live in registers
WARPS = 4  # warps a block
MAX_UNROLL = 8  # words a lane loads a round with 1-2 tokens, over the rows it takes (a q/k/v row of 2048
# inputs is 256 words: one round of 8 words at 1 row a warp, two rounds of 4 words a row at 2 rows)
LONG_RUN_UNROLL = 2  # ... words of each row with 3-8 tokens (as moe_quant.LONG_RUN_VALUES)
# Rows a warp takes (each x word it loads serves all of them; a row's sums are the same whatever the
# rows a warp, lane l taking words l, l + 32, ... in that order), as linear.py's ROWS_PER_WARP_SHORT
# and ROWS_PER_WARP for bf16 (4 and 4: qkv / o 13.0 -> 9.0 us a call at batch 1 in the 48 x 32 graph,
# batch 8 588 -> 668 tok/s): with 1-2 tokens a pass and with 3-8; fewer where a projection's rows would
# then make fewer than MIN_WARPS warps (the o projection's 2048 rows of 4096: with 4 rows a warp 512
# warps, 4 an SM, too few loads in flight). Chosen by that analogy and ptxas (2 x 4 words: 66
# registers; 4 rows at 8 tokens: 126); not yet timed on a GPU (tools/device/quant9_call.sh).
ROWS_PER_WARP_SHORT = 2
ROWS_PER_WARP = 4
MIN_WARPS = 1024
# With 1-2 tokens a pass, each word's sums start from a zero made of the round's words' and scales' bits
# (as moe_quant.ROUND_GATE): ptxas then issues the whole round's loads before its first FFMA. Without it
# the e4m3 instruction's variant (48 registers) issued 6 of its 8 words after compute had begun, in 5
# groups (tools/device/quant11_sass.py); the bit moves' variant issued them first anyway. The same bits.
# Off until timed in the decode graph (moe_quant.ROUND_GATE).
ROUND_GATE = False
# One token: linear_quant_fp8.py's one-round kernel (16-byte words, all of a warp's loads before a block
# barrier, x staged in shared memory) instead of _fp8_rows_kernel: on an H200 (24 x 32, CUPTI in the graph)
# q/k/v 9.47 -> 7.87 us, o 14.94 -> 12.43 (docs/performance.md, fifteenth session).
ONE_ROUND = True
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

@device
def _round_zero(raw, factor, rows, unroll):
    """+0.0 made of the bits of a round's words and scales (ROUND_GATE): AND blockIdx.z, 0 in this 2-D
    grid but unknown to the compilers."""
    bits = uint32(0)
    for r in range(rows):
        for k in range(unroll):
            word = raw[r, k]
            bits |= uint32(word & np.uint64(0xFFFFFFFF)) | uint32(word >> np.uint64(32)) | f32_bits(factor[r, k])
    return bits_as_f32(bits & uint32(cuda.blockIdx.z))


@functools.cache
def _fp8_rows_kernel(chunk: int, hardware: bool, unroll: int, exact: bool, rows: int = 1, gate: bool = False):
    """A warp takes ``rows`` consecutive rows. ``exact``: rows are whole rounds of WARP x unroll words
    (a round's loads need no clamp). ``gate``: ROUND_GATE."""
    decode = decoder("fp8", hardware)

    @kernel
    def fp8_rows(x, codes, scales, row_words, out):
        # x (T, C) float32 as uint64; codes (R, C / 8) as uint64; scales (R, G) float32; out (T, R)
        grid_dependency_wait()  # pdl.py: before any global read or write
        lane, first, stride = warp_rows()
        total_tokens, num_rows = out.shape
        num_groups = (num_rows + rows - 1) // rows
        t0 = cuda.blockIdx.y * chunk
        run = min(chunk, total_tokens - t0)
        acc = cuda.local.array((rows, chunk), float32)
        raw = cuda.local.array((rows, unroll), uint64)
        factor = cuda.local.array((rows, unroll), float32)
        w_buf = cuda.local.array((rows, 2, 4), float32)
        x_buf = cuda.local.array((2, 4), float32)
        for start in range(0, num_groups, stride):
            group = min(start + first, num_groups - 1)
            for r in range(rows):
                for t in range(chunk):
                    acc[r, t] = float32(0.0)
            for base in range(lane, row_words, WARP * unroll):
                for r in range(rows):  # every load of the round in flight before the first use
                    row = uint32(min(group * rows + r, num_rows - 1))  # unsigned: no wraparound arithmetic
                    for k in range(unroll):
                        word = uint32(base + k * WARP) if exact else uint32(min(base + k * WARP, row_words - 1))
                        raw[r, k] = codes[row, word]
                        factor[r, k] = scales[row, word // uint32(WORDS_PER_BLOCK)]
                zero = _round_zero(raw, factor, rows, unroll) if gate else float32(0.0)
                for k in range(unroll):
                    word = base + k * WARP
                    if exact or word < row_words:
                        for r in range(rows):
                            decode(raw[r, k], factor[r, k], float32(0.0), w_buf[r])  # once for the pass's tokens
                        for t in range(chunk):
                            if t < run:  # the same for the whole block: no divergence
                                for i in range(2):
                                    _x_chunk(x, uint32(t0 + t), uint64(4 * word + 2 * i), x_buf[i])
                                for r in range(rows):
                                    dot = zero  # +0.0
                                    for i in range(2):
                                        dot = accumulate(dot, x_buf[i], w_buf[r, i], 4)
                                    acc[r, t] += factor[r, k] * dot
            for r in range(rows):
                warp_sum_many(acc[r], chunk)
            if lane == 0 and start + first < num_groups:  # constant indices keep the sums in registers
                for r in range(rows):
                    if group * rows + r < num_rows:
                        for t in range(chunk):
                            if t < run:
                                out[t0 + t, group * rows + r] = acc[r, t]

    return fp8_rows


def rows_for(num_rows: int, chunk: int) -> int:
    """Rows a warp takes: ROWS_PER_WARP_SHORT with 1-2 tokens a pass, ROWS_PER_WARP with more, halved
    while the projection would get fewer than MIN_WARPS warps."""
    rows = ROWS_PER_WARP_SHORT if chunk <= 2 else ROWS_PER_WARP
    while rows > 1 and ceil_div(num_rows, rows) < MIN_WARPS:
        rows //= 2
    return max(1, rows)


def unroll_for(row_words: int, chunk: int, rows: int = 1) -> tuple[int, bool]:
    """(words of each row a lane loads a round, whether rows are whole rounds): all of a row's where
    they fit with 1-2 tokens a pass, at most MAX_UNROLL over the warp's rows; with more,
    LONG_RUN_UNROLL (at 8 tokens an unroll of 8 spills the sums to local memory, ptx_check), each word
    then serving several tokens."""
    most = max(1, MAX_UNROLL // rows) if chunk <= 2 else LONG_RUN_UNROLL
    unroll = max(1, min(most, ceil_div(row_words, WARP)))
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
    if linear_quant_mma.takes(x, codes, scales, stream):  # MOEBUS_QUANT_MMA=attn: one token on tensor cores
        return linear_quant_mma.launch(x, codes, scales, out, stream)
    if ONE_ROUND and linear_quant_fp8.fits(x, codes, scales):
        return linear_quant_fp8.linear_fp8_one_round(x, codes, scales, out, stream, hardware_e4m3(HARDWARE_E4M3_MIN_RUN))
    chunk = min(MAX_TOKENS, num_tokens)
    row_words = cols // VALUES_PER_WORD
    rows = rows_for(codes.shape[0], chunk)
    kernel_ = _fp8_rows_kernel(chunk, hardware_e4m3(chunk), *unroll_for(row_words, chunk, rows), rows,
                               ROUND_GATE and chunk <= 2)
    grid = (blocks(ceil_div(ceil_div(codes.shape[0], rows), WARPS)), ceil_div(num_tokens, chunk))
    kernel_[grid, threads(WARPS * WARP), stream](x.view(np.uint64), codes.view(np.uint64), scales, row_words, out)
    return out


# -- device: to bf16, for the tensor-core path ----------------------------------------------------------

@kernel
def _to_bf16(codes, scales, out):
    # one thread an element, grid-stride; out (R, C) uint16 bf16 bits, rounded to nearest even
    grid_dependency_wait()  # pdl.py: before any global read or write
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
