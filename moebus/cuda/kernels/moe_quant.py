"""Expert FFNs from quantized experts (fp8 or int4 blobs, common/quant_layout.py), dequantized in
registers: out[pair_out[j]] = down(silu(gate x) * up x), as ``moe.expert_ffn_ref`` for bf16 experts.
Same work split as moe_ffn.py (warp per output row, runs of pairs on one slot inside a chunk, a
negative placement entry read from the mapped host store), so a decode step moves 1 byte (fp8) or
~0.56 byte (int4) per weight instead of 2.

One kernel serves both GEMVs (gate|up: two matrices whose rows pair up, ``GATE_UP_ROWS_*`` of each a
warp, then silu(gate) * up into the scratch h; down: ``DOWN_ROWS_*`` rows a warp). A lane reads
8-byte words of the blob (8 fp8 or 16 4-bit codes, never straddling a block or group: rows are
multiples of 16 values, blocks and groups 128), all of a round's words and their scales in flight
before the first use (as linear.py), then per word: the codes to float32 in registers
(quant_words.py) once for every token of the run, x read as 8-byte words, and the scale applied once
per word and token: fp8 s * sum x_c q_c; int4 s * sum x_c (q_c + m / s) with (s, m) its group's
scale and minimum. Indices are unsigned (numba adds wraparound arithmetic to every signed index) and,
where rows are whole rounds (A3B's are), a round's loads sit at constant offsets of one address: that
halved the instructions a warp issues (tools/device/quant7_sass.py) and made int4 ~1.3x faster, fp8
~1.1x (docs/performance.md). ptxas, though, sinks most of a round's loads next to their uses (a warp's
trips to memory in a row: ~11 for the fp8 gate|up at one token); ROUND_GATE (off until timed) makes
every FFMA of a round wait on all of its loads (tools/device/quant11_sass.py counts them); with runs of
8 tokens on one expert the bound is not established yet (not the instruction count).

Shapes: T tokens, D hidden, I expert intermediate, J listed pairs, B blob bytes."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.common.quant import BLOCK
from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.kernels.compat import (WARP, bits_as_f32, blocks, cuda, data_ptr, device, f32_bits, float32, kernel, threads,
                                       uint32, uint64, warp_sum_many)
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.elementwise import silu_ref
from moebus.cuda.kernels.launch import ceil_div, require
from moebus.cuda.kernels.linear import accumulate
from moebus.cuda.kernels.loads import can_read_wide
from moebus.cuda.kernels.moe_ffn import MAX_CHUNK, MAX_GRID_Y, WARPS, _placement, _run_length, warp_rows
from moebus.cuda.kernels import moe_quant_mma, moe_quant_round
from moebus.cuda.kernels.quant_words import (HARDWARE_E4M3_MIN_RUN, decoder, hardware_e4m3, load_pair, load_streaming,
                                             streaming_round)

# Values in an 8-byte word. (4-byte words, a lane's x reads then 16 bytes apart as bf16's, measured
# 35% slower on an H200: more loads and instructions a byte; docs/performance.md.)
VALUES_PER_WORD = {"fp8": 8, "int4": 16}
# Rows a warp takes (each x word a lane loads serves all of them). Down rows are short (768: 96 fp8
# words, 3 a lane): with runs of 1-2 pairs 4 a warp measured fastest of 1 / 2 / 4 on an H200
# (2026-12-01, event-timed calls of the expert FFN, fp8 and int4, docs/performance.md); with longer
# runs 2 (4 needs local memory there). By format: tools/device/quant9_call.sh times 2 and 3 as well.
DOWN_ROWS_SHORT = {"fp8": 4, "int4": 4}
DOWN_ROWS_LONG = 2
# Gate|up rows (of both matrices) a warp takes with runs of 1-2 pairs and the words of each a lane
# loads a round, by format: fp8 2 rows x 4 words (768 blocks at batch 1, all resident at 80 registers,
# where 1 row x 8 words made 1536, 1.45 waves at 64) measured 3% faster than 1 x 8 in the fifth
# session's event-timed calls, and the same change took bf16's gate|up from 18.2 to 15.3 us a layer in
# the 48 x 32 graph (moe_ffn.GATE_UP_ROWS_SHORT); int4 keeps 1 row x 4 words (a whole row, one round).
# Registers with ROUND_GATE (sm_90): fp8 2 x 4 128, int4 1 x 4 128 (tools/device/quant11_sass.py; with
# unsigned while loops instead of range() 96 and 72, not kept: not timed apart). With longer
# runs GATE_UP_ROWS_LONG rows and LONG_RUN_VALUES values' worth of words. The tests cover 1-3 rows.
GATE_UP_SHORT = {"fp8": (2, 4), "int4": (1, 4)}
GATE_UP_ROWS_LONG = 1
LONG_RUN_VALUES = 16
# weight words loaded evict-first (ld.global.cs), as moe_ffn.STREAM_WEIGHTS for bf16 experts (batch 8
# 799 -> 855 tok/s there): read once a step, they need not push the activations and the attention's
# weights out of the 50 MB L2. A round's words by one asm statement (quant_words.streaming_round): the
# fp8 gate|up then takes 96 registers against 80 (ptxas, sm_90), down 64 against 96. Off until timed.
STREAM_WEIGHTS = False
# Each round's sums start from a zero made of its words' and scales' bits (``round_zero``), so that no
# FFMA of the round can issue before all of its loads are back. The PTX issues the round's loads first,
# but ptxas (sm_90) sank them next to their uses to save registers: the fp8 gate|up issued 12 of its 16
# words after its first FFMA, in 11 groups, int4's 6 of 8 in 6 (tools/device/quant11_sass.py), each
# group another dependent trip to memory in the warp's chain; with the gate they are all issued first.
# The zero is +0.0 (the bits AND blockIdx.z, 0 in these 2-D grids but unknown to the compilers), so the
# sums keep their bits (GPU tests: 42 passed on an H200, 2026-12-02). Off: in the one 24 x 32 figure with
# it on (int4 + fp8 attention, batch 1, with the loops then unsigned while loops: 72.2 us a layer) the experts'
# share came to ~25 us against the ninth session's 22.0 without, and the A/B in the graph was cut by the
# call's time (docs/performance.md). ROUND_GATE_X: the round's x words too.
ROUND_GATE = False
ROUND_GATE_X = False
# Experts with runs of one pair (batch 1): moe_quant_round.py's one-round kernels (16-byte words, all of a
# warp's loads before a block barrier, x staged in shared memory) instead of _rows_kernel. On an H200,
# 24 x 32 A3B all resident, with the FP8 projections' (linear_quant.ONE_ROUND): fp8 experts + fp8 attention
# 616.5 -> 738.1 tok/s (1.07x -> 1.28x bf16's 577.8), int4 631.5 -> 706.0; greedy ids equal, log p within
# 2e-4 (docs/performance.md, fifteenth session).
FP8_ONE_ROUND = True
INT4_ONE_ROUND = True
ONE, SHIFT_HI = np.uint64(1), np.uint64(32)


# -- numpy reference ----------------------------------------------------------------------------------

def expert_ffn_quant_ref(x, pair_token, pair_slot, pair_out, arena, layout: ExpertLayout, out, store=None):
    # x (T, D) float32; pair_* (J,) int32; arena (slots, B) uint8; out (P, D) float32. A negative
    # slot reads row -1 - slot of the host store; rows of out not listed are left alone.
    x = np.asarray(x, dtype=np.float32)
    pair_token, pair_slot, pair_out = (np.asarray(a) for a in (pair_token, pair_slot, pair_out))
    for slot in np.unique(pair_slot):
        pairs = np.nonzero(pair_slot == slot)[0]
        blob = arena[int(slot)] if slot >= 0 else store[-1 - int(slot)]
        gate, up, down = layout.dequantize(np.asarray(blob))
        xs = x[pair_token[pairs]]
        out[pair_out[pairs]] = (silu_ref(xs @ gate.T) * (xs @ up.T)) @ down.T
    return out


@device
def _scale_index_fp8(scale_at, row, col, cols):
    """The float index of the fp8 block scale holding (row, col); scale_at counts 4-byte floats."""
    return uint64(scale_at + (row // BLOCK) * ((cols + BLOCK - 1) // BLOCK) + col // BLOCK)


@device
def _scale_index_int4(scale_at, row, col, cols):
    """The float index of the 4-bit group (row, col)'s scale; its minimum is the next float."""
    return uint64(scale_at + 2 * (row * ((cols + BLOCK - 1) // BLOCK) + col // BLOCK))


@device
def _params_fp8(floats, slot, at):
    return floats[slot, at], float32(0.0)


@device
def _params_int4(floats, slot, at):
    return floats[slot, at], floats[slot, at + ONE]


@device
def _load_plain(array, row, at):
    return array[row, at]


@device
def _x_chunk(x, row, at, buf):
    """4 float32 of x from its uint64 view: words at and at + 1, one 16-byte load (unsigned indices:
    numba then adds no wraparound arithmetic for negative ones)."""
    lo, hi = load_pair(x, row, at)
    buf[0] = bits_as_f32(lo)
    buf[1] = bits_as_f32(lo >> SHIFT_HI)
    buf[2] = bits_as_f32(hi)
    buf[3] = bits_as_f32(hi >> SHIFT_HI)


@device
def round_zero(raw, scales, minima, mats, rows, unroll):
    """+0.0, computed from the bits of every word and scale of a round (see ROUND_GATE)."""
    bits = uint32(0)
    for m in range(mats):
        for r in range(rows):
            for k in range(unroll):
                word = raw[m, r, k]
                bits |= uint32(word & np.uint64(0xFFFFFFFF)) | uint32(word >> SHIFT_HI) | f32_bits(scales[m, r, k]) \
                    | f32_bits(minima[m, r, k])
    return bits_as_f32(bits & uint32(cuda.blockIdx.z))


@device
def x_zero(x_buf, chunks, zero):
    """``zero`` (+0.0) made to depend on the bits of x_buf's floats as well."""
    bits = f32_bits(zero)
    for i in range(chunks):
        for c in range(4):
            bits |= f32_bits(x_buf[i, c])
    return bits_as_f32(bits & uint32(cuda.blockIdx.z))


PARAMS = {"fp8": (_scale_index_fp8, _params_fp8), "int4": (_scale_index_int4, _params_int4)}
# floats between the scale entries of two words WARP apart in a row (WARP words span whole blocks)
SCALE_STEP = {"fp8": WARP * 8 // BLOCK, "int4": 2 * WARP * 16 // BLOCK}


# -- device: the GEMV ------------------------------------------------------------------------------

@functools.cache
def _rows_kernel(fmt: str, chunk: int, mats: int, rows: int, hardware: bool, unroll: int, exact: bool,
                 streaming: bool = False, gate: bool = False, gate_x: bool = False):
    """mats 2: gate|up (a warp takes ``rows`` rows of both, h = silu(gate) * up); mats 1: down (a warp
    takes ``rows`` consecutive rows, out[pair_out] = the sums). ``hardware``: quant_words.decoder's.
    ``exact``: a row is whole rounds of WARP x unroll words, so a round's loads sit at constant offsets
    from one address (no clamp, no test a word). ``streaming``: weight words loaded evict-first.
    ``gate`` / ``gate_x``: ROUND_GATE / ROUND_GATE_X (runs of one pair: ``chunk`` 1)."""
    decode = decoder(fmt, hardware)
    load_word = load_streaming if streaming else _load_plain
    load_round = streaming_round(unroll, WARP) if streaming and exact else None
    scale_index, read_params = PARAMS[fmt]
    per_word = VALUES_PER_WORD[fmt]
    chunks = per_word // 4  # 4-float chunks of x per weight word, 2 x words each
    step = SCALE_STEP[fmt]

    @kernel
    def quant_rows(x, pair_table, pair_slot, arena, arena_f, store, store_f, cols, num_rows, code0, code1,
                   scale0, scale1, first_pair, out):
        # x: (T, cols) float32 as uint64 (gate|up: rows pair_table[j]; down: h, rows j); arena / store:
        # the blobs as uint64 and as float32; code* / scale*: word / float offsets of the matrices
        grid_dependency_wait()  # pdl.py: before any global read or write
        j = first_pair + cuda.blockIdx.y
        run = _run_length(pair_slot, j, chunk)
        if run == 0:
            return  # the whole block: no reduction is skipped by part of it
        words, slot = _placement(arena, store, pair_slot[j])
        floats, _ = _placement(arena_f, store_f, pair_slot[j])
        lane, first, stride = warp_rows()
        row_words = cols // per_word
        num_groups = (num_rows + rows - 1) // rows
        x_rows = cuda.local.array(chunk, uint32)
        for t in range(chunk):  # past the run: its last pair's row (those sums are skipped, never stored)
            x_rows[t] = pair_table[j + min(t, run - 1)] if mats == 2 else j + min(t, run - 1)
        acc = cuda.local.array((mats, rows, chunk), float32)
        raw = cuda.local.array((mats, rows, unroll), uint64)
        scales = cuda.local.array((mats, rows, unroll), float32)
        minima = cuda.local.array((mats, rows, unroll), float32)
        w_buf = cuda.local.array((mats, rows, chunks, 4), float32)
        factor = cuda.local.array((mats, rows), float32)
        x_buf = cuda.local.array((chunks, 4), float32)
        x_round = cuda.local.array((unroll if gate_x else 1, chunks, 4), float32)
        for start in range(0, num_groups, stride):
            group = min(start + first, num_groups - 1)
            for m in range(mats):
                for r in range(rows):
                    for t in range(chunk):
                        acc[m, r, t] = float32(0.0)
            for base in range(lane, row_words, WARP * unroll):
                for m in range(mats):  # every load of the round in flight before the first use
                    code_at, scale_at = (code0, scale0) if m == 0 else (code1, scale1)
                    for r in range(rows):
                        row = min(group * rows + r, num_rows - 1)
                        at = uint64(code_at + row * row_words + base)
                        first_scale = scale_index(scale_at, row, base * per_word, cols)
                        if load_round is not None:  # the round's words in one asm statement
                            load_round(words, slot, at, raw, m, r)
                        for k in range(unroll):
                            if exact:
                                if load_round is None:
                                    raw[m, r, k] = load_word(words, slot, at + uint64(k * WARP))
                                scales[m, r, k], minima[m, r, k] = read_params(floats, slot,
                                                                               first_scale + uint64(k * step))
                            else:
                                word = min(base + k * WARP, row_words - 1)
                                raw[m, r, k] = load_word(words, slot, at + uint64(word - base))
                                scales[m, r, k], minima[m, r, k] = read_params(
                                    floats, slot, scale_index(scale_at, row, word * per_word, cols))
                x_at = uint64(base * 2 * chunks)
                zero = round_zero(raw, scales, minima, mats, rows, unroll) if gate else float32(0.0)
                if gate_x:  # x of the round's words, also before the first FFMA (runs of 1: x_round[k])
                    for k in range(unroll):
                        word = base + k * WARP if exact else min(base + k * WARP, row_words - 1)
                        for i in range(chunks):
                            _x_chunk(x, x_rows[0], uint64(2 * (word * chunks + i)), x_round[k, i])
                    zero = x_zero(x_round[unroll - 1], chunks, zero)
                for k in range(unroll):
                    word = base + k * WARP
                    if (exact or word < row_words) and gate:  # runs of 1: a word decoded and used at once (registers)
                        if not gate_x:
                            for i in range(chunks):
                                _x_chunk(x, x_rows[0], x_at + uint64(2 * (k * WARP * chunks + i)), x_buf[i])
                        for m in range(mats):
                            for r in range(rows):
                                f = decode(raw[m, r, k], scales[m, r, k], minima[m, r, k], w_buf[0, 0])
                                dot = zero  # +0.0
                                for i in range(chunks):
                                    dot = accumulate(dot, x_round[k, i] if gate_x else x_buf[i], w_buf[0, 0, i], 4)
                                acc[m, r, 0] += f * dot
                    elif exact or word < row_words:
                        for m in range(mats):  # each word decoded once for the run's tokens
                            for r in range(rows):
                                factor[m, r] = decode(raw[m, r, k], scales[m, r, k], minima[m, r, k], w_buf[m, r])
                        for t in range(chunk):
                            if t < run:  # the same for the whole block: no divergence
                                if not gate_x:
                                    for i in range(chunks):
                                        _x_chunk(x, x_rows[t], x_at + uint64(2 * (k * WARP * chunks + i)), x_buf[i])
                                for m in range(mats):
                                    for r in range(rows):
                                        dot = zero  # +0.0
                                        for i in range(chunks):
                                            dot = accumulate(dot, x_round[k, i] if gate_x else x_buf[i], w_buf[m, r, i], 4)
                                        acc[m, r, t] += factor[m, r] * dot
            for m in range(mats):
                for r in range(rows):
                    warp_sum_many(acc[m, r], chunk)
            if lane == 0 and start + first < num_groups:  # constant indices keep the sums in registers
                for r in range(rows):
                    row = group * rows + r
                    if row < num_rows:
                        for t in range(chunk):
                            if t < run:
                                if mats == 2:
                                    g = acc[0, r, t]
                                    out[j + t, row] = g / (float32(1.0) + math.exp(-g)) * acc[1, r, t]
                                else:
                                    out[pair_table[j + t], row] = acc[0, r, t]

    return quant_rows


def unroll_for(row_words: int, chunk: int, per_word: int, most: int = 8) -> int:
    """Words of each row a lane loads a round: all of a row's where they fit, at most ``most`` with
    runs of 1-2 pairs (GATE_UP_SHORT's words; down rows of 768 are 3 fp8 words a lane, one round);
    with longer runs LONG_RUN_VALUES values' worth (registers hold the run's sums, and each word then
    serves several tokens), or one more where that makes rows whole rounds (fp8 down rows of 768: 3 a
    lane, not 2; see _round)."""
    most = most if chunk <= 2 else max(1, LONG_RUN_VALUES // per_word)
    unroll = max(1, min(ceil_div(row_words, WARP), most))
    if row_words % (WARP * unroll) and row_words % (WARP * (unroll + 1)) == 0:
        return unroll + 1
    return unroll


def _round(row_words: int, chunk: int, per_word: int, most: int = 8) -> tuple[int, bool]:
    """(words a lane loads a round, whether rows are whole rounds): the kernel's unroll and exact."""
    unroll = unroll_for(row_words, chunk, per_word, most)
    return unroll, row_words % (WARP * unroll) == 0


def work_shape(fmt: str, chunk: int) -> tuple[int, int, int]:
    """(gate|up rows, at most the words of each a lane loads a round, down rows) of a warp with runs of
    up to ``chunk`` pairs."""
    if chunk <= 2:
        rows, words = GATE_UP_SHORT[fmt]
        return rows, words, DOWN_ROWS_SHORT[fmt]
    return GATE_UP_ROWS_LONG, 8, DOWN_ROWS_LONG


def round_hardware() -> bool:
    """Whether the GPU converts e4m3 by instruction, for moe_quant_round.py (through hardware_e4m3, which an
    offline compile sets: tests/cuda/ptx_check.py)."""
    return hardware_e4m3(HARDWARE_E4M3_MIN_RUN)


def one_round(layout: ExpertLayout, chunk: int, arena, store) -> bool:
    """Whether expert_ffn_quant_cuda runs moe_quant_round.py's kernels (FP8_ONE_ROUND, INT4_ONE_ROUND)."""
    fmt = layout.dtype
    if chunk != 1 or not (FP8_ONE_ROUND if fmt == "fp8" else INT4_ONE_ROUND):
        return False
    gate_rows, _, down_rows, _ = moe_quant_round.shape(fmt, round_hardware())
    return (moe_quant_round.fits(layout.hidden, gate_rows, 2, fmt) and moe_quant_round.fits(layout.inter, down_rows, 1, fmt)
            and moe_quant_round.aligned(arena, store))


def expert_ffn_quant_cuda(x, pair_token, pair_slot, pair_out, arena, layout: ExpertLayout, out, scratch, stream=0,
                          store=None):
    """expert_ffn_quant_ref on device arrays. ``arena`` and ``store``: (slots, B) uint8 blobs of
    ``layout``; ``scratch``: (J, I) float32 for the activations between the two kernels; x and
    scratch 16-byte aligned (their rows are read 16 bytes a lane)."""
    hidden, inter = layout.hidden, layout.inter
    num_pairs = pair_slot.shape[0]
    require("x", x, np.float32, shape=(None, hidden))
    for name, table in (("pair_token", pair_token), ("pair_slot", pair_slot), ("pair_out", pair_out)):
        require(name, table, np.int32, shape=(num_pairs,))
    require("arena", arena, np.uint8, shape=(None, layout.blob_bytes))
    store = arena if store is None else store
    require("store", store, np.uint8, shape=(None, layout.blob_bytes))
    require("out", out, np.float32, shape=(None, hidden))
    require("scratch", scratch, np.float32, shape=(None, inter))
    if num_pairs > scratch.shape[0]:
        raise ValueError(f"{num_pairs} pairs: more than the {scratch.shape[0]} scratch rows")
    for name, array in (("x", x), ("scratch", scratch)):  # rows of x and h are read 16 bytes a lane
        if not (can_read_wide(array) and data_ptr(array) % 16 == 0):
            raise ValueError(f"{name}: the quantized expert GEMVs need a C-ordered, 16-byte aligned array")
    if num_pairs == 0:
        return out
    chunk = min(MAX_CHUNK, x.shape[0])  # one token's pairs have distinct experts: runs <= tokens
    per_word = VALUES_PER_WORD[layout.dtype]
    offsets = layout.kernel_words()  # 4-byte units: codes in 8-byte words below, scales in floats
    gate_w, up_w, down_w, gate_s, up_s, down_s = (*(n // 2 for n in offsets[:3]), *offsets[3:])
    blobs = (arena.view(np.uint64), arena.view(np.float32), store.view(np.uint64), store.view(np.float32))
    hardware = layout.dtype == "fp8" and hardware_e4m3(chunk)
    gate_rows, gate_words, down_rows = work_shape(layout.dtype, chunk)
    gate, gate_x = ROUND_GATE and chunk == 1, ROUND_GATE_X and chunk == 1
    gate_up = _rows_kernel(layout.dtype, chunk, 2, gate_rows, hardware,
                           *_round(hidden // per_word, chunk, per_word, gate_words), STREAM_WEIGHTS, gate, gate_x)
    down = _rows_kernel(layout.dtype, chunk, 1, down_rows, hardware, *_round(inter // per_word, chunk, per_word),
                        STREAM_WEIGHTS, gate, gate_x)
    h = scratch[:num_pairs]
    x_words, h_words = x.view(np.uint64), h.view(np.uint64)
    block = threads(WARPS * WARP)
    per_block = block // WARP
    per_launch = MAX_GRID_Y // chunk * chunk  # launch boundaries on chunk boundaries: runs stay whole
    if moe_quant_mma.takes(layout, chunk, arena, store, stream):  # MOEBUS_QUANT_MMA: fp8 at batch 1 on tensor cores
        moe_quant_mma.launch(x, pair_token, pair_slot, pair_out, arena, store, layout, h, out, stream)
        return out
    if one_round(layout, chunk, arena, store):
        can_convert = round_hardware()
        round_gate_up, round_down = moe_quant_round.kernels(hidden, inter, block, layout.dtype, can_convert)
        round_gate_rows, _, round_down_rows, _ = moe_quant_round.shape(layout.dtype, can_convert)
        for first in range(0, num_pairs, per_launch):
            count = min(per_launch, num_pairs - first)
            round_gate_up[(blocks(ceil_div(ceil_div(inter, round_gate_rows), per_block)), count), block, stream](
                x_words, pair_token, pair_slot, *blobs, inter, gate_w, up_w, gate_s, up_s, first, pair_out, h)
        for first in range(0, num_pairs, per_launch):
            count = min(per_launch, num_pairs - first)
            round_down[(blocks(ceil_div(ceil_div(hidden, round_down_rows), per_block)), count), block, stream](
                h_words, pair_token, pair_slot, *blobs, hidden, down_w, down_w, down_s, down_s, first, pair_out, out)
        return out
    for first in range(0, num_pairs, per_launch):
        count = min(per_launch, num_pairs - first)
        gate_up[(blocks(ceil_div(ceil_div(inter, gate_rows), per_block)), count), block, stream](
            x_words, pair_token, pair_slot, *blobs, hidden, inter, gate_w, up_w, gate_s, up_s, first, h)
    for first in range(0, num_pairs, per_launch):
        count = min(per_launch, num_pairs - first)
        down[(blocks(ceil_div(ceil_div(hidden, down_rows), per_block)), count), block, stream](
            h_words, pair_out, pair_slot, *blobs, inter, hidden, down_w, down_w, down_s, down_s, first, out)
    return out
