"""Expert FFNs from the arena: out[pair_out[j]] = down(silu(gate x) * up x) for each listed pair j,
with x = x[pair_token[j]] and the expert in arena slot pair_slot[j] (see moe.py for the layout and
``expert_ffn_ref``, the reference).

A negative slot is a placement-table entry for an expert that is not resident (routing.py): the
kernels then read its row of the host store, which on cuda is mapped pinned memory (zero copy).

Two kernels, both warp-per-output-row GEMVs like linear.py (a warp may take a few rows at once: the
``*_ROWS_*`` constants below): gate|up (rows of I, writes the activation h (J, I) to scratch) then
down (rows of D). Pairs are cut into *runs*: consecutive pairs
on the same slot inside one aligned chunk of ``chunk`` pairs; the block of a run's first pair
computes the whole run, so an expert's rows are read once for all its tokens in the chunk (the
stage sorts pairs by slot), and blocks of other pairs return at once. A pair's arithmetic is the
same whatever else is in its run, so results depend neither on the batch nor on the slot."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import WARP, blocks, cuda, device, float32, int32, threads, warp_sum_many, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait, launch_dependents, prefetch_span, released_early
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, ceil_div, require
from moebus.cuda.kernels.linear import accumulate
from moebus.cuda.kernels.loads import can_read_wide, chunk_reader, reader_view, storage_of

MAX_CHUNK = 8  # pairs per run at most: per-lane accumulators live in registers
WARPS = 4
MAX_GRID_Y = 65535  # pairs per launch; more go in several launches
UNROLL = 4  # weight words each lane loads before using them (linear.py) where the run is long
MAX_UNROLL = 8  # ... and at most where runs are short (decode at batch 1: one token per run)
# down rows a warp takes at once (down_shape), as measured on an H200 (2026-12-02, decode7_1.sh, 48 x 32
# bench): 4 where runs are long took batch 8 from 668 to 711 tok/s; 2 where short took the down kernel
# at batch 1 from 13.6 to 12.0 us a layer (decode8_1.sh's CUPTI profile of the 48 x 32 graph; 4: 12.1)
DOWN_ROWS_SHORT = 2
DOWN_ROWS_LONG = 4
# rows of I a gate|up warp takes at once where runs are short (decode at batch 1), its words a lane
# a round then MAX_UNROLL // GATE_UP_ROWS_SHORT: the same bytes in flight a warp, half the blocks (768
# at batch 1: one wave of 6 blocks an SM, not 1.94). 2 took the kernel from 18.2 to 15.3 us a layer
# (H200, decode8_2.sh's profile of the 48 x 32 graph); 2 rows x 8 words a round: 21.1
GATE_UP_ROWS_SHORT = 2
# the experts' weights loaded evict-first (ld.global.cs): 75 MB a layer at batch 1 pass through the
# 50 MB L2 without pushing out what the next kernels read (activations, the KV cache). Measured on an
# H200 (decode7_2.sh, 48 x 32 bench): batch 8 799 -> 855 tok/s; batch 1 within the run's noise
STREAM_WEIGHTS = True
# pdl.py, with edges from the PROGRAMMATIC port (pdl.released_early): gate|up lets the down GEMV launch
# once all its blocks have waited, and down then reads its pair's slot (the routing's, two kernels back:
# complete by then) and asks L2 for its first rows of the expert's down matrix before it waits for
# gate|up. Off until measured.
PREFETCH_DOWN_BEFORE_WAIT = False
# the down GEMV where runs are short (batch 1): at most DOWN_BLOCKS_SHORT blocks along its rows (0: a
# block a 4 row groups, 256 at A3B's 2048, one round a warp: 2048 short blocks at batch 1, ~3 waves,
# each waiting on HBM from scratch), each warp then taking several row groups in turn; with
# DOWN_PREFETCH_NEXT it asks L2 for its next group's rows (prefetch.global.L2, resident experts only)
# before it computes the current one, so their bytes come from HBM while it reduces and writes. A row's
# sum is the same whichever warp takes it: same bits. Off until measured (thirteenth session).
DOWN_BLOCKS_SHORT = 0
DOWN_PREFETCH_NEXT = False


def unroll_for(words: int, chunk: int) -> int:
    """Weight words a lane loads before their first use: all of a row's words where they fit (the
    down rows of 768 are 6 a lane: one round, none wasted), else as many as registers allow."""
    return max(1, min(ceil_div(words, WARP), MAX_UNROLL if chunk <= 2 else UNROLL))


@cuda.jit(device=True)
def _run_length(pair_slot, j, chunk):
    """Pairs in the run that starts at pair j, or 0 when j does not start one."""
    slot = pair_slot[j]
    if j % chunk != 0 and pair_slot[j - 1] == slot:
        return 0
    n = 1
    while n < chunk and j + n < pair_slot.shape[0] and (j + n) % chunk != 0 and pair_slot[j + n] == slot:
        n += 1
    return n


@device
def warp_rows():
    """(lane, first row group, stride) of this thread in a warp-per-row-group grid-stride GEMV: x
    over row groups, a block's warps on consecutive groups (as linear.py)."""
    warps = cuda.blockDim.x // WARP
    return cuda.threadIdx.x % WARP, cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP, cuda.gridDim.x * warps


@device
def _placement(arena, store, entry):
    """(array, row) of a placement-table entry: an arena slot, or (negative) a host-store row."""
    if entry >= 0:
        return arena, entry
    return store, -1 - entry


@functools.cache
def _gate_up_kernel(storage: str, wide: bool, chunk: int, unroll: int, streaming: bool, per_warp: int = 1,
                    release: bool = False):
    read_weight, width = chunk_reader(storage, wide, streaming)
    read_x, _ = chunk_reader("f32", wide)

    @kernel
    def expert_gate_up(x, pair_token, pair_slot, arena, store, hidden_words, inter, first_pair, h):
        # a warp takes per_warp consecutive rows of I (their gate and up rows) at once
        grid_dependency_wait()  # pdl.py: before any global read or write
        if release:
            launch_dependents()  # the down GEMV may launch: the routing before this kernel is complete
        j = first_pair + cuda.blockIdx.y
        run = _run_length(pair_slot, j, chunk)
        if run == 0:
            return  # the whole block: no reduction is skipped by part of it
        weights, slot = _placement(arena, store, pair_slot[j])
        lane, first, stride = warp_rows()
        num_groups = (inter + per_warp - 1) // per_warp
        up_base = inter * hidden_words
        tokens = cuda.local.array(chunk, int32)
        for t in range(chunk):  # past the run: its last pair's token (never read: t < run below)
            tokens[t] = pair_token[j + min(t, run - 1)]
        acc_gate = cuda.local.array((per_warp, chunk), float32)
        acc_up = cuda.local.array((per_warp, chunk), float32)
        gate_buf = cuda.local.array((per_warp, unroll, width), float32)
        up_buf = cuda.local.array((per_warp, unroll, width), float32)
        x_buf = cuda.local.array(width, float32)
        for start in range(0, num_groups, stride):
            group = min(start + first, num_groups - 1)
            for r in range(per_warp):
                for t in range(chunk):
                    acc_gate[r, t] = float32(0.0)
                    acc_up[r, t] = float32(0.0)
            for base in range(lane, hidden_words, WARP * unroll):
                for r in range(per_warp):  # the loads in flight first (linear.py)
                    row = min(group * per_warp + r, inter - 1)
                    for k in range(unroll):
                        word = min(base + k * WARP, hidden_words - 1)
                        read_weight(weights, slot, row * hidden_words + word, gate_buf[r, k])
                        read_weight(weights, slot, up_base + row * hidden_words + word, up_buf[r, k])
                for k in range(unroll):
                    word = base + k * WARP
                    if word < hidden_words:
                        for t in range(chunk):
                            if t < run:  # the same in the whole block: no divergence, no work past the run
                                read_x(x, tokens[t], word, x_buf)
                                for r in range(per_warp):
                                    acc_gate[r, t] = accumulate(acc_gate[r, t], x_buf, gate_buf[r, k], width)
                                    acc_up[r, t] = accumulate(acc_up[r, t], x_buf, up_buf[r, k], width)
            for r in range(per_warp):
                warp_sum_many(acc_gate[r], chunk)
                warp_sum_many(acc_up[r], chunk)
            if lane == 0 and start + first < num_groups:  # constant indices keep the sums in registers
                for r in range(per_warp):
                    if group * per_warp + r < inter:
                        for t in range(chunk):
                            if t < run:
                                g = acc_gate[r, t]
                                h[j + t, group * per_warp + r] = g / (float32(1.0) + math.exp(-g)) * acc_up[r, t]

    return expert_gate_up


@functools.cache
def _down_kernel(storage: str, wide: bool, chunk: int, unroll: int, per_warp: int, streaming: bool,
                 prefetch: bool = False, prefetch_next: bool = False):
    read_weight, width = chunk_reader(storage, wide, streaming)
    read_h, _ = chunk_reader("f32", wide)
    line_words = 16 if wide else 64  # 128 bytes of uint64 words or of 2-byte elements

    @kernel
    def expert_down(h, pair_slot, pair_out, arena, store, hidden, inter_words, first_pair, out):
        # a warp takes per_warp consecutive output rows at once: each h word it loads serves all
        j = first_pair + cuda.blockIdx.y
        if prefetch:  # PREFETCH_DOWN_BEFORE_WAIT: pair_slot is the routing's, complete (gate|up released us)
            if _run_length(pair_slot, j, chunk) > 0:
                early, early_slot = _placement(arena, store, pair_slot[j])
                row0 = min((cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP) * per_warp,
                           hidden - 1)
                at = 2 * hidden * inter_words + row0 * inter_words
                prefetch_span(early, early_slot, at, min(at + per_warp * inter_words, early.shape[1]), line_words)
        grid_dependency_wait()  # pdl.py: before any global read or write (the prefetch's slot read aside)
        run = _run_length(pair_slot, j, chunk)
        if run == 0:
            return
        weights, slot = _placement(arena, store, pair_slot[j])
        lane, first, stride = warp_rows()
        num_groups = (hidden + per_warp - 1) // per_warp
        down_base = 2 * hidden * inter_words
        rows = cuda.local.array(chunk, int32)  # rows of h: this run's pairs
        for t in range(chunk):
            rows[t] = j + min(t, run - 1)
        acc = cuda.local.array((per_warp, chunk), float32)
        w_buf = cuda.local.array((per_warp, unroll, width), float32)
        h_buf = cuda.local.array(width, float32)
        resident = pair_slot[j] >= 0  # the next group's prefetch: arena rows only, not the host store's
        for start in range(0, num_groups, stride):
            group = min(start + first, num_groups - 1)
            if prefetch_next and resident and start + stride + first < num_groups:
                for r in range(per_warp):
                    at = down_base + min((start + stride + first) * per_warp + r, hidden - 1) * inter_words
                    prefetch_span(weights, slot, at, at + inter_words, line_words)
            for r in range(per_warp):
                for t in range(chunk):
                    acc[r, t] = float32(0.0)
            for base in range(lane, inter_words, WARP * unroll):
                for r in range(per_warp):
                    row = min(group * per_warp + r, hidden - 1)
                    for k in range(unroll):
                        word = min(base + k * WARP, inter_words - 1)
                        read_weight(weights, slot, down_base + row * inter_words + word, w_buf[r, k])
                for k in range(unroll):
                    word = base + k * WARP
                    if word < inter_words:
                        for t in range(chunk):
                            if t < run:
                                read_h(h, rows[t], word, h_buf)
                                for r in range(per_warp):
                                    acc[r, t] = accumulate(acc[r, t], h_buf, w_buf[r, k], width)
            for r in range(per_warp):
                warp_sum_many(acc[r], chunk)
            if lane == 0 and start + first < num_groups:
                for r in range(per_warp):
                    if group * per_warp + r < hidden:
                        for t in range(chunk):
                            if t < run:
                                out[pair_out[j + t], group * per_warp + r] = acc[r, t]

    return expert_down


def gate_up_shape(hidden_words: int, chunk: int) -> tuple[int, int]:
    """(words a lane loads per round, rows of I a warp takes) of the gate|up kernel."""
    rows = GATE_UP_ROWS_SHORT if chunk <= 2 else 1
    return max(1, unroll_for(hidden_words, chunk) // rows), rows


def down_shape(inter_words: int, chunk: int) -> tuple[int, int]:
    """(words a lane loads per round, rows a warp takes) of the down kernel: a down row is short
    (768 wide: 6 words a lane, all loaded in one round), so more rows a warp mean more bytes in
    flight; with runs of several pairs each h word it loads serves every row it takes."""
    if chunk <= 2 or DOWN_ROWS_LONG == 1:
        return unroll_for(inter_words, 1), DOWN_ROWS_SHORT if chunk <= 2 else 1
    return min(2, unroll_for(inter_words, chunk)), DOWN_ROWS_LONG


def expert_ffn_cuda(x, pair_token, pair_slot, pair_out, arena, hidden: int, inter: int, out, scratch, stream=0,
                    store=None):
    """expert_ffn_ref on device arrays. ``scratch``: a (J, inter) float32 device array for the
    activations between the two kernels. Slots and tokens must be in range (the stage's tables).
    ``store``: the host store as the device sees it (mapped pinned memory), for negative entries."""
    num_tokens = x.shape[0]
    num_pairs = pair_slot.shape[0]
    require("x", x, np.float32, shape=(None, hidden))
    for name, table in (("pair_token", pair_token), ("pair_slot", pair_slot), ("pair_out", pair_out)):
        require(name, table, np.int32, shape=(num_pairs,))
    require("arena", arena, WEIGHT_DTYPES, ndim=2)
    store = arena if store is None else store
    require("store", store, arena.dtype, shape=(None, arena.shape[1]))
    if arena.shape[1] < 3 * hidden * inter:
        raise ValueError(f"arena slots of {arena.shape[1]} elements cannot hold 3 x {hidden} x {inter}")
    require("out", out, np.float32, shape=(None, hidden))
    require("scratch", scratch, np.float32, shape=(None, inter))
    if num_pairs > scratch.shape[0]:
        raise ValueError(f"{num_pairs} pairs: more than the {scratch.shape[0]} scratch rows")
    if num_pairs == 0:
        return out
    wide = (can_read_wide(arena, hidden, inter) and can_read_wide(store) and can_read_wide(x)
            and can_read_wide(scratch))
    width = 4 if wide else 1
    chunk = min(MAX_CHUNK, num_tokens)  # one token's pairs have distinct experts: runs <= tokens
    storage = storage_of(arena)
    h = scratch[:num_pairs]
    block = threads(WARPS * WARP)
    per_block = block // WARP
    arena_view, store_view = reader_view(arena, wide), reader_view(store, wide)
    hidden_words, inter_words = hidden // width, inter // width
    gate_unroll, gate_rows = gate_up_shape(hidden_words, chunk)
    early = PREFETCH_DOWN_BEFORE_WAIT and released_early()
    gate_up = _gate_up_kernel(storage, wide, chunk, gate_unroll, STREAM_WEIGHTS, gate_rows, early)
    down_unroll, per_warp = down_shape(inter_words, chunk)
    down = _down_kernel(storage, wide, chunk, down_unroll, per_warp, STREAM_WEIGHTS, early,
                        DOWN_PREFETCH_NEXT and chunk <= 2)
    down_blocks = ceil_div(ceil_div(hidden, per_warp), per_block)
    if chunk <= 2 and DOWN_BLOCKS_SHORT > 0:
        down_blocks = min(down_blocks, DOWN_BLOCKS_SHORT)
    x_view, h_view = reader_view(x, wide), reader_view(h, wide)
    per_launch = MAX_GRID_Y // chunk * chunk  # launch boundaries on chunk boundaries: runs stay whole
    for first in range(0, num_pairs, per_launch):
        count = min(per_launch, num_pairs - first)
        gate_up[(blocks(ceil_div(ceil_div(inter, gate_rows), per_block)), count), block, stream](
            x_view, pair_token, pair_slot, arena_view, store_view, hidden_words, inter, first, h)
    for first in range(0, num_pairs, per_launch):
        count = min(per_launch, num_pairs - first)
        down[(blocks(down_blocks), count), block, stream](
            h_view, pair_slot, pair_out, arena_view, store_view, hidden, inter_words, first, out)
    return out
