"""FP8 dense projections (linear_quant.py's weights: e4m3 codes (R, C), a float32 scale per row and 128
inputs) for one token, in one round a warp: moe_quant_round.py's GEMV (16-byte words, all of a warp's
loads before a block barrier, x staged in shared memory) over a weight's rows. linear_quant.py's kernel
issues 8-byte words, and ptxas sank most of them next to their uses (tools/device/quant11_sass.py); its
o projection (2,048 rows of 4,096) measured slower than bf16's (8.31 vs 7.04 us in the 24 x 32 graph).

A warp takes ``rows_for(C)`` rows (as many as keep a lane's words at MAX_WORDS or fewer: q/k/v's rows of
2,048 inputs 2 a warp, o's of 4,096 1), 32 / rows lanes a row. Shapes: R rows (outputs), C columns (inputs)."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.compat import WARP, blocks, bounded_kernel, cuda, float32, threads, uint32, uint64, warp_sum_many
from moebus.cuda.kernels.launch import ceil_div
from moebus.cuda.kernels.moe_quant_round import VALUES_PER_WORD, aligned, round_parts
from moebus.cuda.kernels.pdl import grid_dependency_wait

MAX_WORDS = 8  # 16-byte words a lane at most (registers: 8 words and their scales)
WARPS = 4
STREAM_WEIGHTS = True  # evict-first, as moe_quant_round.STREAM_WEIGHTS
HARDWARE_E4M3 = True  # e4m3 by the conversion instruction where the GPU has it (the same values)
MIN_BLOCKS = 0  # registers capped for this many blocks of 128 threads an SM (0: none)
# A warp's first words loaded before grid_dependency_wait (pdl.py): a weight never changes within a step,
# so with the decode graph's programmatic edges its bytes come from HBM while the kernel before ends (as
# linear.py's bf16 GEMV asks L2 for its first rows before it waits). x is read after the wait. Measured
# on an H200 (24 x 32, fp8 experts + attention): 690.4 tok/s against 691.0 without: no gain, off.
LOAD_BEFORE_WAIT = False


def rows_for(cols: int) -> int:
    """Rows a warp takes: the most of 1, 2, 4, 8 that keep a lane's words at MAX_WORDS or fewer."""
    words = cols // VALUES_PER_WORD
    rows = 1
    while rows < 8 and ceil_div(words * rows * 2, WARP) <= MAX_WORDS:
        rows *= 2
    return rows


def fits(x, codes, scales) -> bool:
    """Whether one token's projection suits this kernel (whole 16-byte words a row, aligned arrays)."""
    return (x.shape[0] == 1 and codes.shape[1] % VALUES_PER_WORD == 0 and codes.shape[1] <= WARP * MAX_WORDS * VALUES_PER_WORD
            and aligned(x, codes))


@functools.cache
def dense_kernel(cols: int, rows: int, streaming: bool, hardware: bool, block: int, min_blocks: int = 0,
                 early: bool = False):
    """``early``: LOAD_BEFORE_WAIT."""
    load, stage, dot, per_lane = round_parts(cols, rows, 1, streaming, hardware, block)
    lanes = WARP // rows
    shared_words = cols // 2
    warps = block // WARP

    @bounded_kernel(block, min_blocks)
    def fp8_dense_one_round(x, codes, scales, num_rows, out):
        # x (1, C) float32 as uint64; codes (R, C / 8) uint64; scales (R, G) float32; out (1, R) float32
        if not early:
            grid_dependency_wait()  # pdl.py: before any global read or write
        xs = cuda.shared.array(shared_words, uint64)
        tid = uint32(cuda.threadIdx.x)
        lane = tid % uint32(WARP)
        sub, mine = lane % uint32(lanes), lane // uint32(lanes)
        num_groups = (num_rows + rows - 1) // rows
        lo = cuda.local.array((1, per_lane), uint64)
        hi = cuda.local.array((1, per_lane), uint64)
        scale = cuda.local.array((1, per_lane), float32)
        minimum = cuda.local.array((1, per_lane), float32)  # int4's; unused here
        part = cuda.local.array(rows, float32)
        first = cuda.blockIdx.x * warps + tid // uint32(WARP)
        for start in range(0, num_groups, cuda.gridDim.x * warps):  # the same trips in every warp of the block
            group = min(start + first, num_groups - 1)
            row = uint32(min(group * rows + mine, num_rows - 1))
            load(codes, row, uint64(0), scales, row, uint64(0), sub, lo, hi, scale, minimum, 0)
            if start == 0:  # x into shared memory, then the barrier that keeps the loads above it
                if early:  # every thread of the grid waits here (the first trip is every warp's)
                    grid_dependency_wait()  # pdl.py: the weights only were read before it
                stage(x, 0, xs, tid)
                cuda.syncthreads()
            acc = dot(lo, hi, scale, minimum, 0, sub, xs)
            for r in range(rows):
                part[r] = acc if mine == uint32(r) else float32(0.0)
            warp_sum_many(part, rows)
            if lane == 0 and start + first < num_groups:
                for r in range(rows):
                    if group * rows + r < num_rows:
                        out[0, group * rows + r] = part[r]

    return fp8_dense_one_round


def linear_fp8_one_round(x, codes, scales, out, stream=0, hardware: bool = True):
    """out (1, R) = x (1, C) @ the FP8 weight ^T (linear_quant.linear_fp8_cuda checked the arguments);
    ``hardware``: whether the GPU converts e4m3 by instruction (the caller's: quant_words.hardware_e4m3)."""
    num_rows, cols = codes.shape
    rows = rows_for(cols)
    block = threads(WARPS * WARP)
    fn = dense_kernel(cols, rows, STREAM_WEIGHTS, HARDWARE_E4M3 and hardware, block, MIN_BLOCKS, LOAD_BEFORE_WAIT)
    fn[blocks(ceil_div(ceil_div(num_rows, rows), block // WARP)), block, stream](
        x.view(np.uint64), codes.view(np.uint64), scales, num_rows, out)
    return out

