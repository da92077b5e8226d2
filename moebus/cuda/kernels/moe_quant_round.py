"""The quantized expert GEMVs for runs of one pair (decode at batch 1), in one round a warp: fp8 (and int4,
the same way). Every 16-byte word of codes a lane will use is loaded before any is used, and ptxas cannot
sink them next to their uses (as it did in moe_quant.py's kernels: ~11 dependent trips to memory a warp
in the fp8 gate|up, tools/device/quant11_sass.py), because a block barrier follows the loads: the
block's x (gate|up) or h (down) row is staged into shared memory between the loads and the first use,
and a load may not move past ``syncthreads``. The same results as moe_quant.py's kernels within float32
rounding (a lane adds 16 or 32 products a word where those add 8 or 16), checked against the numpy
reference (moe_quant.expert_ffn_quant_ref).

Work split: a warp takes ``rows`` consecutive output rows of each matrix (gate|up: both), ``32 / rows``
lanes a row; a lane reads words sub, sub + lanes, ... of its row (fp8: 16 codes a word, one 128-wide
scale block; int4: 32, one group), K = ceil(W / lanes) of them (W: 16-byte words a row; A3B fp8
gate|up rows of 2048: 128 words, at 1 row a warp 4 a lane and matrix; down rows of 768: 48, at 8 rows
a warp 12 a lane). Each word's codes become float32 in registers (fp8: quant_words' bit moves or the
e4m3 conversion instruction, the same values; int4: q + m / s by byte permutes, as quant_words.decoder),
their products with x summed, then times the word's scale. The block's x sits in shared memory as
[16-byte chunk within word][word] so that lanes reading consecutive words hit consecutive banks and
lanes of other rows reading the same word get it broadcast. A row's sum: the warp's lanes masked by
row, xor butterflies (compat.warp_sum_many).

Shapes: D hidden, I expert intermediate, W 16-byte words a row."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.common.quant import BLOCK
from moebus.cuda.kernels.compat import (WARP, bits_as_f32, bounded_kernel, cuda, data_ptr, device, float32, uint32, uint64,
                                       warp_sum_many)
from moebus.cuda.kernels.moe_ffn import _placement
from moebus.cuda.kernels.pdl import grid_dependency_wait, released_early
from moebus.cuda.kernels.quant_words import (NIBBLES, fast_quotient, e4m3_quad, int4_quad, load_pair,
                                             load_pair_ordered, load_pair_streaming)

VALUES_PER_WORD = 16  # e4m3 codes in a 16-byte word
VALUES = {"fp8": VALUES_PER_WORD, "int4": 32}  # codes in a 16-byte word by format
# Rows a warp takes (32 / rows lanes a row), registers capped for MIN_BLOCKS blocks of 128 threads an SM
# (0: none), e4m3 by the conversion instruction (cvt.rn.f16x2.e4m3x2, sm_89+; else bit moves: the same
# values), by kernel. Registers by ptxas (sm_90, tools/device/quant15_sass.py): gate|up 1 row (A3B: 4
# words a lane and matrix, 1,536 blocks at batch 1) 72, 2 rows (8 words, 768 blocks) 119 capped for 4
# blocks an SM; down 8 rows (12 words a lane, 512 blocks) 97, 4 rows 64. On an H200 (24 x 32 A3B, all
# resident, fp8 experts + fp8 attention, the quant15.sh call): gate|up 1 row 738.1 tok/s against 2 rows
# 691.0 (CUPTI 16.4 vs 20.2 us a layer); down 4 rows 693.3 against 8 rows 691.0 (noise).
GATE_UP_ROWS = 1
GATE_UP_MIN_BLOCKS = 0
GATE_UP_HARDWARE = True
DOWN_ROWS = 8
DOWN_MIN_BLOCKS = 0
DOWN_HARDWARE = True
# fp8 rows a warp where e4m3 is decoded by bit moves (a GPU without the instruction, or *_HARDWARE off):
# gate|up 2 rows and down 8 went through local memory there
GATE_UP_ROWS_BIT_MOVES = 1
DOWN_ROWS_BIT_MOVES = 4
# int4 (32 codes a 16-byte word; A3B gate|up rows 64 words, down 24): rows a warp and register caps, as
# above. Gate|up 1 row (2 words a lane and matrix: 72 registers; at 2 or 4 rows NVVM left the word loop
# rolled and the words went through local memory), down 8 rows (6 words a lane, 72 registers).
INT4_GATE_UP_ROWS = 1
INT4_GATE_UP_MIN_BLOCKS = 0
INT4_DOWN_ROWS = 8
INT4_DOWN_MIN_BLOCKS = 0
# The down GEMV's pair tables and words read before its PDL wait, h after it: only where pdl.released_early()
# (the routing, two kernels back, is then complete, as for moe_ffn.PREFETCH_DOWN_BEFORE_WAIT) and only
# while every expert of the stage is resident and none lent (an arena slot is then never rewritten within a
# step; with an evicting cache whether an upload may rewrite a slot between the routing and the down GEMV
# is not established): the down matrices' bytes then come from HBM while gate|up ends. The decode step
# decides (choose_down_early, from Stage._run) and a captured graph keeps the choice: Stage._graph_for
# recaptures a graph captured with them where down_early_for turns false (a shrink on a VRAM reserve, a loan:
# between steps); one captured without them stays (safe, and no capture beside a step launched ahead) until
# something else recaptures it (a cache that fills up after its first steps runs without them till then).
# Measured (H200, 24 x 32, with the projections' early loads, gate|up 2 rows): 722.7 tok/s against 691.0
# (down 11.9 -> 9.4 us, CUPTI); 48 x 32 all resident b1 (quant16.sh, call A): fp8 379.9 -> 391.2 tok/s, int4
# 363.7 -> 376.3, the greedy ids and log p equal to the step without them.
DOWN_LOAD_BEFORE_WAIT = True
_down_early = False  # the step being launched's choice (choose_down_early)
MAX_WORDS = 16  # 16-byte words a lane at most (``fits``)
# weight words loaded evict-first (ld.global.cs.v2.u64), as moe_ffn.STREAM_WEIGHTS
STREAM_WEIGHTS = True


def down_early_for(experts) -> bool:
    """Whether a decode step over ``experts`` (the stage's expert cache; None: not a routed decode step) may
    read the down GEMV's words before its PDL wait: DOWN_LOAD_BEFORE_WAIT, quantized experts, every expert
    resident and no loan (no upload then rewrites a slot)."""
    store = getattr(experts, "store", None)
    return (DOWN_LOAD_BEFORE_WAIT and getattr(store, "layout", None) is not None and experts.not_resident == 0
            and getattr(experts, "loaned_from", None) is None)


def choose_down_early(experts) -> bool:
    """down_early_for(experts), kept for the kernels the step chooses next (``kernels``); returned."""
    global _down_early
    _down_early = down_early_for(experts)
    return _down_early


def fits(cols: int, rows: int, mats: int = 1, fmt: str = "fp8") -> bool:
    """Whether rows of ``cols`` codes suit this kernel with ``rows`` rows a warp: whole 16-byte words, and
    at most MAX_WORDS words a lane over the matrices (registers: A3B's fp8 gate|up 2 x 8, down 12)."""
    values = VALUES[fmt]
    return cols % values == 0 and WARP % rows == 0 and mats * -(-(cols // values) // (WARP // rows)) <= MAX_WORDS


def aligned(*arrays) -> bool:
    """16-byte loads need 16-byte aligned arrays (blobs are 16-byte multiples: quant_layout.ALIGN)."""
    return all(data_ptr(a) % 16 == 0 for a in arrays)


@functools.cache
def round_parts(cols: int, rows: int, mats: int, streaming: bool, hardware: bool, block: int, fmt: str = "fp8"):
    """The device functions of a one-round GEMV over rows of ``cols`` codes, ``rows`` rows a warp (also
    linear_quant_fp8.py's):
    - load(words, wslot, at, floats, fslot, scale_at, sub, lo, hi, scale, minimum, m): the lane's words of
      a row (8-byte words from words[wslot, at]: 2 a 16-byte word) and their block's / group's scale
      (fp8: floats[fslot, scale_at + word's block]; int4: the (scale, minimum) pair at scale_at + 2 x the
      word's group) into lo / hi / scale / minimum[m, k], k < K; words past a row's end get scale 0;
    - stage(x, x_row, xs, tid): the block's threads copy x's row into the shared xs as
      [16-byte chunk within word][word] (call it, then syncthreads);
    - dot(lo, hi, scale, minimum, m, sub, xs): the lane's share of the row's sum (int4: s (sum x (q + m / s)),
      as quant_words.decoder's)."""
    values = VALUES[fmt]
    int4 = fmt == "int4"
    lanes = WARP // rows
    row_words = cols // values  # W
    per_lane = -(-row_words // lanes)  # K
    exact = row_words % lanes == 0
    quads = cols // 4  # 16-byte chunks of x (4 floats)
    chunks = values // 4  # ... a word
    stage_trips = -(-quads // block)
    load_word = load_pair_streaming if streaming else load_pair
    decode = e4m3_quad(hardware)
    words_per_scale = uint32(BLOCK // values)
    floats_per_scale = 2 if int4 else 1
    scale_step = (floats_per_scale * lanes // (BLOCK // values)
                  if exact and lanes % (BLOCK // values) == 0 else 0)
    mask32 = uint64(0xFFFFFFFF)

    @device
    def load(words, wslot, at, floats, fslot, scale_at, sub, lo, hi, scale, minimum, m):
        for k in range(per_lane):
            word = sub + uint32(k * lanes)
            if not exact:
                word = min(word, uint32(row_words - 1))
            lo[m, k], hi[m, k] = load_word(words, wslot, at + uint64(2 * word))
            if scale_step:  # lanes a multiple of a block's words: the scales at constant offsets from the first
                where = scale_at + uint64(floats_per_scale * (sub // words_per_scale)) + uint64(k * scale_step)
            else:
                where = scale_at + uint64(floats_per_scale * (word // words_per_scale))
            s = floats[fslot, where]
            scale[m, k] = s if exact or sub + uint32(k * lanes) < uint32(row_words) else float32(0.0)
            if int4:
                minimum[m, k] = floats[fslot, where + uint64(1)]

    @device
    def stage(x, x_row, xs, tid):
        for trip in range(stage_trips):
            chunk = uint32(trip * block) + tid  # x[4 chunk .. 4 chunk + 3]: word chunk // chunks, part chunk % chunks
            if quads % block == 0 or chunk < uint32(quads):
                a, b = load_pair_ordered(x, x_row, uint64(2 * chunk))  # after the PDL wait, wherever that is
                at_s = 2 * ((chunk % uint32(chunks)) * uint32(row_words) + chunk // uint32(chunks))
                xs[at_s] = a
                xs[at_s + uint32(1)] = b

    @device
    def word_dot(lo, hi, scale, minimum, m, k, sub, xs):  # the lane's k-th word of the row: scale x sum
        quad = cuda.local.array(4, float32)
        pair = cuda.local.array((2, 4), float32)
        word = sub + uint32(k * lanes)
        if not exact:
            word = min(word, uint32(row_words - 1))
        total = float32(0.0)
        if int4:
            offset = fast_quotient(minimum[m, k], scale[m, k]) if exact or sub + uint32(k * lanes) < uint32(row_words) \
                else float32(0.0)
        for q in range(4):
            half = uint32(((lo[m, k] if q < 2 else hi[m, k]) >> uint64(32 * (q % 2))) & mask32)
            if int4:  # 8 codes: chunks 2q and 2q + 1 of the word
                int4_quad(half & NIBBLES, offset, pair, 0, 0)
                int4_quad((half >> uint32(4)) & NIBBLES, offset, pair, 0, 1)
                for h in range(2):
                    at_s = 2 * (uint32((2 * q + h) * row_words) + word)
                    a, b = xs[at_s], xs[at_s + uint32(1)]
                    total += bits_as_f32(a & mask32) * pair[h, 0]
                    total += bits_as_f32(a >> uint64(32)) * pair[h, 1]
                    total += bits_as_f32(b & mask32) * pair[h, 2]
                    total += bits_as_f32(b >> uint64(32)) * pair[h, 3]
            else:
                decode(half, quad)
                at_s = 2 * (uint32(q * row_words) + word)
                a, b = xs[at_s], xs[at_s + uint32(1)]
                total += bits_as_f32(a & mask32) * quad[0]
                total += bits_as_f32(a >> uint64(32)) * quad[1]
                total += bits_as_f32(b & mask32) * quad[2]
                total += bits_as_f32(b >> uint64(32)) * quad[3]
        return scale[m, k] * total

    @device
    def dot(lo, hi, scale, minimum, m, sub, xs):
        acc = float32(0.0)
        for k in range(per_lane):
            acc += word_dot(lo, hi, scale, minimum, m, k, sub, xs)
        return acc

    return load, stage, dot, per_lane


@functools.cache
def one_round_kernel(cols: int, mats: int, rows: int, streaming: bool, hardware: bool, block: int, min_blocks: int = 0,
                     fmt: str = "fp8", early: bool = False):
    """mats 2: gate|up (h[j, row] = silu(gate x) * up x), mats 1: down (out[pair_out[j], row]); runs of
    one pair; rows of ``cols`` codes, ``rows`` of them a warp; ``block`` threads a block; ``min_blocks``: registers
    capped for that many blocks an SM (compat.bounded_kernel; 0: as ptxas likes); ``early``: the down GEMV's
    words loaded before the PDL wait (DOWN_LOAD_BEFORE_WAIT)."""
    load, stage, dot, per_lane = round_parts(cols, rows, mats, streaming, hardware, block, fmt)
    int4 = fmt == "int4"
    lanes = WARP // rows
    row_words = cols // VALUES[fmt]
    scale_cols = -(-cols // BLOCK)
    shared_words = cols // 2
    sums = mats * rows
    warps = block // WARP

    @bounded_kernel(block, min_blocks)
    def quant_one_round(x, x_table, pair_slot, arena, arena_f, store, store_f, num_rows, code0, code1, scale0,
                      scale1, first_pair, out_table, out):
        # x: (T, cols) float32 as uint64 (gate|up: row x_table[j]; down: h, row j); arena / store: the
        # blobs as uint64 and float32; code* / scale*: 8-byte word and float offsets of the matrices
        if not early:
            grid_dependency_wait()  # pdl.py: before any global read or write
        xs = cuda.shared.array(shared_words, uint64)  # x's 16-byte chunks as [chunk within word][word]
        j = first_pair + cuda.blockIdx.y
        words, slot = _placement(arena, store, pair_slot[j])
        floats, _ = _placement(arena_f, store_f, pair_slot[j])
        tid = uint32(cuda.threadIdx.x)
        lane = tid % uint32(WARP)
        sub, mine = lane % uint32(lanes), lane // uint32(lanes)  # word offset and row of this lane in its warp
        num_groups = (num_rows + rows - 1) // rows
        x_row = x_table[j] if mats == 2 else j
        dest = out_table[j]  # down's output row, read once (not again before each store)
        lo = cuda.local.array((mats, per_lane), uint64)
        hi = cuda.local.array((mats, per_lane), uint64)
        scale = cuda.local.array((mats, per_lane), float32)
        minimum = cuda.local.array((mats, per_lane), float32)
        part = cuda.local.array(sums, float32)
        first = cuda.blockIdx.x * warps + tid // uint32(WARP)
        for start in range(0, num_groups, cuda.gridDim.x * warps):  # the same trips in every warp of the block
            group = min(start + first, num_groups - 1)
            row = uint32(min(group * rows + mine, num_rows - 1))
            for m in range(mats):  # every word of the warp's rows, and its scale, in flight
                code_at, scale_at = (code0, scale0) if m == 0 else (code1, scale1)
                scale_row = row * uint32(2 * scale_cols) if int4 else (row // uint32(BLOCK)) * uint32(scale_cols)
                load(words, slot, uint64(code_at) + uint64(row * uint32(2 * row_words)), floats, slot,
                     uint64(scale_at) + uint64(scale_row), sub, lo, hi, scale, minimum, m)
            if start == 0:  # x into shared memory, then the barrier that keeps the loads above it
                if early:  # every thread of the grid waits here (the first trip is every warp's)
                    grid_dependency_wait()  # pdl.py: only the routing's tables and the weights were read before it
                stage(x, x_row, xs, tid)
                cuda.syncthreads()
            for i in range(sums):
                part[i] = float32(0.0)
            for m in range(mats):
                acc = dot(lo, hi, scale, minimum, m, sub, xs)
                for r in range(rows):
                    part[m * rows + r] = acc if mine == uint32(r) else part[m * rows + r]
            warp_sum_many(part, sums)
            if lane == 0 and start + first < num_groups:
                for r in range(rows):
                    out_row = group * rows + r
                    if out_row < num_rows:
                        if mats == 2:
                            g = part[r]
                            out[j, out_row] = g / (float32(1.0) + math.exp(-g)) * part[rows + r]
                        else:
                            out[dest, out_row] = part[r]

    return quant_one_round


def shape(fmt: str, hardware: bool = True) -> tuple[int, int, int, int]:
    """(gate|up rows, its MIN_BLOCKS, down rows, its MIN_BLOCKS) a warp for ``fmt``; ``hardware``: whether
    the GPU converts e4m3 by instruction (without, fp8 takes the *_BIT_MOVES rows)."""
    if fmt == "int4":
        return INT4_GATE_UP_ROWS, INT4_GATE_UP_MIN_BLOCKS, INT4_DOWN_ROWS, INT4_DOWN_MIN_BLOCKS
    down_rows = DOWN_ROWS if hardware and DOWN_HARDWARE else DOWN_ROWS_BIT_MOVES
    if hardware and GATE_UP_HARDWARE:
        return GATE_UP_ROWS, GATE_UP_MIN_BLOCKS, down_rows, DOWN_MIN_BLOCKS
    return GATE_UP_ROWS_BIT_MOVES, 0, down_rows, DOWN_MIN_BLOCKS


def kernels(hidden: int, inter: int, block: int, fmt: str = "fp8", hardware: bool = True):
    """(gate|up kernel, down kernel) at the constants above; ``hardware``: whether the GPU converts e4m3
    by instruction (quant_words.can_convert_e4m3; the caller's, so that an offline compile can set it)."""
    gate_rows, gate_blocks, down_rows, down_blocks = shape(fmt, hardware)
    early = _down_early and released_early()
    return (one_round_kernel(hidden, 2, gate_rows, STREAM_WEIGHTS, GATE_UP_HARDWARE and hardware, block, gate_blocks, fmt),
            one_round_kernel(inter, 1, down_rows, STREAM_WEIGHTS, DOWN_HARDWARE and hardware, block, down_blocks, fmt,
                             early))
