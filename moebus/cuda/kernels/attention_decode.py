"""The attention kernel of steps of few tokens (decode), streaming the KV cache at HBM speed.

One block per (token, kv head, split). A token's positions [lo, pos] are cut into splits of at
least SPLIT_POSITIONS positions, at most DECODE_SPLITS of them, so that one token at a long context
fills the GPU (a function of the token alone, never of the batch: a token's output does not depend
on what runs beside it). Within a block, the warps read whole cache rows with 8-byte loads: a row of
hd elements is spread over LPR lanes (QPL loads of 4 elements each per lane), so a warp reads
32 / LPR rows at once; the query heads of the kv head's group are spread over HS warps of HPW heads
each (each lane keeps its elements of its heads' queries and outputs in registers), and the rows
over STREAMS warps. A row's score is the lanes' partial dot products summed over the row's LPR
lanes (xor shuffles); each row group keeps its own online softmax (running max and sum) and output,
so nothing is shared until the end, when the row groups' states are combined through shared memory
into the split's (output, max, sum) for merge_splits.

With ``merge=True`` (``MERGE_IN_SPLIT``, given a counter per (token, kv head)) the kernel merges
too: the last split block of a (token, kv head) to finish (``routing.is_last_of``, which the block
resets, so a replayed graph finds it at 0) merges the splits of the group's heads as merge_splits
does, in the same order (the same bits), with each thread's loads of MERGE_SPLITS splits in flight
at once: one launch a layer instead of two. The merges (``merger``, WIDE_MERGE) take a round trip to
L2 for every split's max at once, then one for every MERGE_SPLITS splits' values and sums; apart
(merge_splits) a block per (token, head) does the same.

DECODE_SPLITS is the decode kernel's own count (the scratch holds the larger of it and MAX_SPLITS,
attention_chunk_tc's); the kernel compiles with the split constants of its call (``splitter``), so a
setting changed between calls takes effect; ``split_range`` (attention_chunk's merge of decode rows)
reads them when its caller compiles."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import (FULL_MASK, SIMULATOR, WARP, bits_as_f32, bounded_kernel, cuda, device,
                                        device_with_shared, float32, kernel, uint64)
from moebus.cuda.kernels.pdl import grid_dependency_wait, prefetch_l2
from moebus.cuda.kernels.launch import ceil_div
from moebus.cuda.kernels.routing import is_last_of

SPLIT_POSITIONS = 32  # a split has at least this many positions (a short context spreads over blocks)...
DECODE_SPLITS = 64  # ...and a decode token at most this many splits (with MAX_SPLITS, bounds the scratch)
MAX_SPLITS = 64  # attention_chunk_tc's splits of a tile at most (imported by value there: its own count)
ROWS_AHEAD = 4  # rows each row group loads before it computes (bytes in flight)
MAX_HEADS_PER_WARP = 4  # query heads whose queries and outputs a lane keeps in registers
MAX_SHARED_BYTES = 40 * 1024
MERGE_IN_SPLIT = True  # attention_cuda: the last split block merges (given a counter), no merge_splits launch
MERGE_SPLITS = 4  # splits whose partials a merging thread loads at once (the last split block's merge)...
MERGE_APART_SPLITS = 16  # ...and merge_splits' (one output a thread: registers to spare). The same bits at any count
MERGE_THREADS = 128  # merge_splits: a block per (token, head), its threads over the head's dims
# the merges (the last split block's, merge_splits) with their loads in flight (merger: 1 + splits /
# MERGE_SPLITS round trips to L2, a block per head apart); off: the fourteenth session's (2 splits /
# MERGE_SPLITS round trips in the block; apart a thread an output, a round trip a split). The same bits
WIDE_MERGE = True
# bf16 caches at hd 128 (a group of <= 8 heads, no window) on tensor cores (attention_decode_tc.cu, NVRTC; a
# GPU and a stream object), in splits of at least TC_SPLIT_POSITIONS, merged apart (WIDE_MERGE's merge_splits);
# off (or fp32, a window, the simulator): this kernel. H200, b1, 48 x 32 a3b shapes, attention alone (fifteenth
# session): 1k / 4k / 32k 9.7 / 17.6 / 34.2 us against this kernel's 18.0 / 32.0 / 58.1, error 2.2e-11
DECODE_TC = True
TC_SPLIT_POSITIONS = 64
# the tensor-core kernel merges too (given counters, MERGE_IN_SPLIT): a token of one split writes its output
# directly, else the last split block merges (merger's order: merge_splits' bits), one launch a layer instead
# of two; only where a token of the cache has at most TC_MERGE_MAX_SPLITS splits (attention.merges_in_split: the
# host knows the cache's positions, not the tokens'), since one block a (token, kv head) merges slower than
# merge_splits' block a head at many splits. H200, sixteenth session (decode16.sh, call A): attention alone, b1,
# 64 / 96 / 1k / 32k positions 4.7 / 7.0 / 9.4 / 35.2 us merged in the split kernel against 6.7 / 6.9 / 7.4 / 28.2
# apart; b1 on M48 (bench decode's cache of 104 positions, 2 splits at most) 3.267 -> 3.232 ms, with TC_PDL 3.186
TC_MERGE_IN_SPLIT = True
TC_MERGE_MAX_SPLITS = 2
# the tensor-core kernel waits first in every block (griddepcontrol.wait, then the trigger: pdl.py), under an entry
# name of its own that pdl.waiting_functions lists, so the captured decode graph's edge into it is programmatic
# like every numba kernel's (without: a full edge, the layer's attention launched only once qkv_rope_store has
# drained; the fifteenth session's DECODE_TC brought that edge in). H200, b1 on M48 (sixteenth session, call A):
# 3.267 -> 3.241 ms a step (merge apart), 3.232 -> 3.186 (merged in the split kernel); the same bits
TC_PDL = True
# the tensor-core kernel's grid: (T, KVH, min(DECODE_SPLITS, ceil(max_context / TC_SPLIT_POSITIONS))), the most
# splits a token can have, not the scratch's splits (max_splits: >= 32 positions a split), whose blocks past a
# token's splits return at once (a 1k cache: 16 a (token, kv head), not 32; bench decode's 104 positions: 2, not 4).
# The same bits. Off: call A (sixteenth session) saw no change at bench decode's 104 positions (3.186 / 3.184 ms)
TC_GRID_SPLITS = False
# softmax in base 2 inside a split: the queries scaled by log2(e) as they are loaded, exp2 (one MUFU.EX2
# and a range fix) instead of expf (~8 instructions) per head and row; the split's max goes out in
# natural units (x ln 2), so merging is unchanged. Not the same bits as base e (within the tests' tolerances)
FAST_EXP = True
# rows ahead of a block's loads whose lines it asks L2 for (prefetch.global.L2, no registers): the
# registers of ROWS_AHEAD bound the bytes a block has in flight from HBM (two blocks an SM at 126
# registers a thread), a prefetch distance does not. 0: none
L2_AHEAD = 0
LINE_WORDS = 16  # 8-byte words in a 128-byte line
# blocks of the decode kernel an SM must hold (launch bounds: registers capped to allow them); 0: the
# compiler's choice (126 registers at A3B's shapes: 2 blocks of 256 threads, which the L2 prefetches or
# more rows ahead push past 128, to 1 block an SM). 0 again since the fifteenth session: with 2, every worker
# start of its calls compiled a kernel the disk cache should have held ("42 loaded from the disk cache, 1
# compiled"), and the decode path runs on tensor cores (DECODE_TC) where this kernel would matter most
MIN_BLOCKS = 0
# a row's scores reduce-scattered over its lanes (log2 of the lanes' shuffles a head instead of one
# butterfly a head): each lane ends with one head's score and keeps that head's online softmax alone
# (the max, the sum, the exp), then hands each head's p (and, where a max grew, alpha) to the row's
# lanes with one shuffle a head. Where the heads of a warp are not a power of two, or more than the
# lanes of a row, the plain split. Not the same bits as the butterfly (within the tests' tolerances)
OWNER_SOFTMAX = True  # with FAST_EXP, ROWS_AHEAD 4 (and MIN_BLOCKS 2): 32k attention 85.0 -> 68.7 us (fourteenth session)
LOG2E = float32(1.4426950408889634)
LN2 = float32(0.6931471805599453)
NEG_INF = float32(-np.inf)
LO16 = np.uint64(0xFFFF)
HI16 = np.uint64(0xFFFF0000)


@functools.cache
def splitter(decode_splits: int, split_positions: int):
    """(split_range, window_split) device functions of ``decode_splits`` splits at most, of at least
    ``split_positions`` positions each (the constants at their compile time: one pair per setting)."""

    @device
    def split_range_of(lo, pos, split):
        count = pos - lo + 1
        num_splits = min(decode_splits, (count + split_positions - 1) // split_positions)
        return lo + split * count // num_splits, lo + (split + 1) * count // num_splits, num_splits

    @device
    def window_split_of(pos, window, split):
        return split_range_of(max(pos - window + 1, 0) if window > 0 else 0, pos, split)

    return split_range_of, window_split_of


@device
def split_range(lo, pos, split):
    """Positions [first, end) of split ``split`` of a token attending to [lo, pos], and how many
    splits the token has (never more than positions, so no split is empty): at most DECODE_SPLITS of
    at least SPLIT_POSITIONS positions (the module's values when the calling kernel compiles)."""
    count = pos - lo + 1
    num_splits = min(DECODE_SPLITS, (count + SPLIT_POSITIONS - 1) // SPLIT_POSITIONS)
    return lo + split * count // num_splits, lo + (split + 1) * count // num_splits, num_splits


@device
def window_split(pos, window, split):
    """split_range of a token at ``pos`` attending to its last ``window`` positions (all: window 0)."""
    return split_range(max(pos - window + 1, 0) if window > 0 else 0, pos, split)


def max_splits(max_context: int) -> int:
    """Splits a token can have in a cache of ``max_context`` positions: a decode token's, or a chunk
    tile's (attention_chunk_tc, at most MAX_SPLITS) where those are more (the scratch holds both)."""
    return min(max(DECODE_SPLITS, MAX_SPLITS), ceil_div(max_context, SPLIT_POSITIONS))


@device
def quad_bf16(words, row, quad, buf, at):
    u = words[uint64(row), uint64(quad)]  # unsigned: no wraparound of a negative index (never one here)
    buf[at] = bits_as_f32((u & LO16) << 16)
    buf[at + 1] = bits_as_f32(u & HI16)
    buf[at + 2] = bits_as_f32((u >> 16) & HI16)
    buf[at + 3] = bits_as_f32((u >> 32) & HI16)


@device
def quad_f32(words, row, quad, buf, at):
    lo = words[uint64(row), uint64(2 * quad)]
    hi = words[uint64(row), uint64(2 * quad + 1)]
    buf[at] = bits_as_f32(lo)
    buf[at + 1] = bits_as_f32(lo >> 32)
    buf[at + 2] = bits_as_f32(hi)
    buf[at + 3] = bits_as_f32(hi >> 32)


QUAD = {"bf16": quad_bf16, "fp32": quad_f32}  # 4 elements of a cache row (as 8-byte words) into registers

if SIMULATOR:
    from moebus.cuda.kernels import sim_warps

    def lanes_sum(value, width):
        """Sum over the ``width`` lanes (a power of two) of this lane's aligned group, in the GPU's
        xor-butterfly order."""
        lane, warp, half = sim_warps._exchange()
        warp.values[half, lane, 0] = value
        warp.barrier.wait(lane)
        first = lane - lane % width
        values = warp.values[half, first:first + width, 0].copy()
        offset = width // 2
        while offset > 0:
            values = values + values[np.arange(width) ^ offset]
            offset //= 2
        return values[lane - first]

    def _swap(value):
        lane, warp, half = sim_warps._exchange()
        warp.values[half, lane, 0] = value
        warp.barrier.wait(lane)
        return lane, warp.values[half, :, 0]

    def xor_of(value, offset):
        """shfl_xor_sync: the value of lane ^ offset."""
        lane, values = _swap(value)
        return values[lane ^ offset]

    def lane_of(value, source):
        """shfl_sync: the value of lane ``source``."""
        return _swap(value)[1][source]

    def any_lane(flag):
        lane, warp, half = sim_warps._exchange()
        warp.indices[half, lane] = 1 if flag else 0
        warp.barrier.wait(lane)
        return bool(warp.indices[half].any())
else:
    @device
    def lanes_sum(value, width):
        offset = width // 2
        while offset > 0:
            value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
            offset //= 2
        return value

    @device
    def xor_of(value, offset):
        return cuda.shfl_xor_sync(FULL_MASK, value, offset)

    @device
    def lane_of(value, source):
        return cuda.shfl_sync(FULL_MASK, value, source)

    @device
    def any_lane(flag):
        return cuda.any_sync(FULL_MASK, flag)


def _largest_divisor(n: int, at_most: int, power_of_two: bool = False) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0 and (not power_of_two or d & (d - 1) == 0))


def layout(head_dim: int, group: int, max_heads: int = 0) -> tuple:
    """(LPR lanes per row, QPL loads per lane, HPW heads per warp, HS warps per group, STREAMS)."""
    quads = head_dim // 4
    lanes = _largest_divisor(quads, 16, power_of_two=True)
    heads = _largest_divisor(group, max_heads or MAX_HEADS_PER_WARP)
    head_sets = group // heads
    rows_per_warp = WARP // lanes
    per_stream = rows_per_warp * group * head_dim * 4  # shared bytes of one stream's states
    streams = max(1, min((2 if SIMULATOR else 8) // head_sets, MAX_SHARED_BYTES // per_stream))
    if streams * per_stream > MAX_SHARED_BYTES:
        raise ValueError(f"attention of {group} heads of {head_dim} per kv head needs more shared memory")
    return lanes, quads // lanes, heads, head_sets, streams


def decode_kernel(storage: str, head_dim: int, group: int, merge: bool = False):
    """(kernel, threads per block) for a cache of ``storage`` ('bf16' | 'fp32'). ``merge``: the
    kernel that also merges the splits (two more arguments: the counters (T * KVH,) int32 at 0, and
    out (T, H, hd))."""
    lanes, quads, heads, head_sets, streams = layout(head_dim, group)
    owner = bool(OWNER_SOFTMAX) and heads <= lanes and heads & (heads - 1) == 0
    return _decode_kernel(storage, head_dim, group, lanes, quads, heads, head_sets, streams, ROWS_AHEAD, merge,
                          MERGE_SPLITS, bool(FAST_EXP), int(L2_AHEAD), int(MIN_BLOCKS), owner, int(DECODE_SPLITS),
                          int(SPLIT_POSITIONS), bool(WIDE_MERGE)), head_sets * streams * WARP


@functools.cache
def _decode_kernel(storage, head_dim, group, lanes, quads, heads, head_sets, streams, rows_ahead, merge, chunk_splits,
                   fast_exp=False, l2_ahead=0, min_blocks=0, owner=False, decode_splits=64, split_positions=32,
                   wide_merge=True):
    load_quad = QUAD[storage]
    window_split = splitter(decode_splits, split_positions)[1]
    row_lines = -(-(head_dim // 4 * (1 if storage == "bf16" else 2)) // LINE_WORDS)  # 128-byte lines of a row
    q_factor = LOG2E if fast_exp else float32(1.0)  # scores in base 2 (fast_exp) or e
    exp_in = math.exp2 if fast_exp else math.exp  # exp_in(score - max): the split's own softmax
    max_out = LN2 if fast_exp else float32(1.0)  # the split's max in natural units for the merge
    per_lane = 4 * quads  # elements of a row per lane
    rows_per_warp = WARP // lanes
    subs = streams * rows_per_warp  # row groups of the block: rows read at once
    step = subs * rows_ahead
    num_threads = head_sets * streams * WARP
    heads_size, rows_size, scores_size = heads * per_lane, rows_ahead * per_lane, rows_ahead * heads

    @device_with_shared
    def combine_row_groups(t, kv_head, split, sub, chunk, first_head, acc, run_max, run_sum, partial):
        # the row groups' (output, max, sum) through shared memory into the split's, in a fixed order
        outs = cuda.shared.array((subs, group, head_dim), float32)
        stats = cuda.shared.array((subs, group, 2), float32)
        for h in range(heads):
            for i in range(per_lane):
                outs[sub, first_head + h, 4 * ((i // 4) * lanes + chunk) + i % 4] = acc[h * per_lane + i]
            if chunk == 0:
                stats[sub, first_head + h, 0] = run_max[h]
                stats[sub, first_head + h, 1] = run_sum[h]
        cuda.syncthreads()
        for e in range(cuda.threadIdx.x, group * head_dim, num_threads):
            j, d = e // head_dim, e % head_dim
            peak = NEG_INF
            for s in range(subs):
                peak = max(peak, stats[s, j, 0])
            total = float32(0.0)
            value = float32(0.0)
            for s in range(subs):
                weight = exp_in(stats[s, j, 0] - peak)  # 0 for a row group that saw no row
                total += stats[s, j, 1] * weight
                value += outs[s, j, d] * weight
            head = kv_head * group + j
            partial[t, head, split, d] = value
            if d == 0:
                partial[t, head, split, head_dim] = peak * max_out
                partial[t, head, split, head_dim + 1] = total

    @device
    def ask_l2(k_words, v_words, base, begin, rows, end, tid):
        # prefetch.global.L2 of every line of K's and V's rows [begin, min(begin + rows, end)), spread over the block
        for n in range(tid, rows * row_lines * 2, num_threads):
            r = begin + n // (row_lines * 2)
            if r < end:
                at = ((n // 2) % row_lines) * LINE_WORDS
                if n % 2 == 0:
                    prefetch_l2(k_words, base + r, at)
                else:
                    prefetch_l2(v_words, base + r, at)

    @device_with_shared
    def split_part(q, k_words, v_words, num_kv_heads, context, token_slot, scale, partial, t, kv_head, split, first,
                   end):
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        head_set, stream = warp % head_sets, warp // head_sets
        chunk = lane % lanes  # which words of a row this lane reads
        sub = stream * rows_per_warp + lane // lanes
        first_head = head_set * heads  # within the group
        q_reg = cuda.local.array(heads_size, float32)
        acc = cuda.local.array(heads_size, float32)
        k_reg = cuda.local.array(rows_size, float32)
        v_reg = cuda.local.array(rows_size, float32)
        scores = cuda.local.array(scores_size, float32)
        run_max = cuda.local.array(heads, float32)
        run_sum = cuda.local.array(heads, float32)
        for h in range(heads):
            run_max[h] = NEG_INF
            run_sum[h] = float32(0.0)
            for i in range(per_lane):
                d = 4 * ((i // 4) * lanes + chunk) + i % 4
                q_reg[h * per_lane + i] = q[t, kv_head * group + first_head + h, d] * scale * q_factor
                acc[h * per_lane + i] = float32(0.0)
        base = (token_slot[t] * num_kv_heads + kv_head) * context
        if l2_ahead > 0:  # the first l2_ahead rows' lines, K and V, one request a thread
            ask_l2(k_words, v_words, base, first, l2_ahead, end, tid)
        for start in range(first, end, step):  # the same trip count in every warp (shuffles)
            if l2_ahead > 0:  # the rows l2_ahead past this round's
                ask_l2(k_words, v_words, base, start + l2_ahead, step, end, tid)
            for a in range(rows_ahead):  # every load first: rows_ahead rows in flight per lane
                row = base + min(start + a * subs + sub, end - 1)
                for w in range(quads):
                    load_quad(k_words, row, w * lanes + chunk, k_reg, a * per_lane + 4 * w)
                    load_quad(v_words, row, w * lanes + chunk, v_reg, a * per_lane + 4 * w)
            for a in range(rows_ahead):
                for h in range(heads):
                    dot = float32(0.0)
                    for i in range(per_lane):
                        dot += q_reg[h * per_lane + i] * k_reg[a * per_lane + i]
                    scores[a * heads + h] = lanes_sum(dot, lanes)
            for a in range(rows_ahead):
                if start + a * subs + sub < end:
                    for h in range(heads):
                        score = scores[a * heads + h]
                        if score > run_max[h]:  # rare after the first rows: rescale only then
                            alpha = exp_in(run_max[h] - score)
                            run_sum[h] *= alpha
                            for i in range(per_lane):
                                acc[h * per_lane + i] *= alpha
                            run_max[h] = score
                        p = exp_in(score - run_max[h])
                        run_sum[h] += p
                        for i in range(per_lane):
                            acc[h * per_lane + i] += p * v_reg[a * per_lane + i]
        combine_row_groups(t, kv_head, split, sub, chunk, first_head, acc, run_max, run_sum, partial)

    log_heads = heads.bit_length() - 1  # owner: heads a power of two, at most lanes
    log_lanes = lanes.bit_length() - 1
    spread = lanes // heads  # lanes that own one head after the reduce-scatter

    @device_with_shared
    def split_part_owner(q, k_words, v_words, num_kv_heads, context, token_slot, scale, partial, t, kv_head, split,
                         first, end):
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        head_set, stream = warp % head_sets, warp // head_sets
        chunk = lane % lanes
        sub = stream * rows_per_warp + lane // lanes
        first_head = head_set * heads
        row_lane = lane - chunk  # the row group's first lane; head h's owners: row_lane + h * spread + ...
        q_reg = cuda.local.array(heads_size, float32)
        acc = cuda.local.array(heads_size, float32)
        k_reg = cuda.local.array(rows_size, float32)
        v_reg = cuda.local.array(rows_size, float32)
        part = cuda.local.array(heads, float32)
        scores = cuda.local.array(rows_ahead, float32)  # this lane's head's score of each row
        for h in range(heads):
            for i in range(per_lane):
                d = 4 * ((i // 4) * lanes + chunk) + i % 4
                q_reg[h * per_lane + i] = q[t, kv_head * group + first_head + h, d] * scale * q_factor
                acc[h * per_lane + i] = float32(0.0)
        own_max = NEG_INF  # of this lane's head (chunk // spread)
        own_sum = float32(0.0)
        base = (token_slot[t] * num_kv_heads + kv_head) * context
        if l2_ahead > 0:
            ask_l2(k_words, v_words, base, first, l2_ahead, end, tid)
        for start in range(first, end, step):  # the same trip count in every warp (shuffles)
            if l2_ahead > 0:
                ask_l2(k_words, v_words, base, start + l2_ahead, step, end, tid)
            for a in range(rows_ahead):
                row = base + min(start + a * subs + sub, end - 1)
                for w in range(quads):
                    load_quad(k_words, row, w * lanes + chunk, k_reg, a * per_lane + 4 * w)
                    load_quad(v_words, row, w * lanes + chunk, v_reg, a * per_lane + 4 * w)
            for a in range(rows_ahead):
                for h in range(heads):
                    dot = float32(0.0)
                    for i in range(per_lane):
                        dot += q_reg[h * per_lane + i] * k_reg[a * per_lane + i]
                    part[h] = dot
                for k in range(log_heads):  # reduce-scatter: keep the half of the heads this lane's bit picks
                    half = heads >> (k + 1)
                    upper = (chunk & (lanes >> (k + 1))) != 0
                    for j in range(half):
                        low, high = part[j], part[j + half]  # both loaded: a select of values, not of addresses
                        keep = high if upper else low
                        send = low if upper else high
                        part[j] = keep + xor_of(send, lanes >> (k + 1))
                score = part[0]
                for k in range(log_heads, log_lanes):  # the rest: a butterfly of the one value
                    score += xor_of(score, lanes >> (k + 1))
                scores[a] = score
            for a in range(rows_ahead):
                valid = start + a * subs + sub < end
                score = scores[a]
                grew = valid and score > own_max
                if any_lane(grew):  # the same in every lane of the warp: the shuffles below are too
                    alpha = exp_in(own_max - score) if grew else float32(1.0)
                    if grew:
                        own_max = score
                    own_sum *= alpha
                    for h in range(heads):
                        scale_h = lane_of(alpha, row_lane + h * spread)
                        for i in range(per_lane):
                            acc[h * per_lane + i] *= scale_h
                p = exp_in(score - own_max) if valid else float32(0.0)
                own_sum += p
                for h in range(heads):
                    p_h = lane_of(p, row_lane + h * spread)
                    for i in range(per_lane):
                        acc[h * per_lane + i] += p_h * v_reg[a * per_lane + i]
        run_max = cuda.local.array(heads, float32)
        run_sum = cuda.local.array(heads, float32)
        for h in range(heads):  # every head's state from its owner, for the row groups' combine
            run_max[h] = lane_of(own_max, row_lane + h * spread)
            run_sum[h] = lane_of(own_sum, row_lane + h * spread)
        combine_row_groups(t, kv_head, split, sub, chunk, first_head, acc, run_max, run_sum, partial)

    part_of_split = split_part_owner if owner else split_part

    merge_group = merger(head_dim, group, num_threads, decode_splits, chunk_splits) if wide_merge else \
        _peaks_merger(head_dim, group, num_threads, chunk_splits)

    if not merge:
        @bounded_kernel(num_threads, min_blocks)
        def attention_split(q, k_words, v_words, num_kv_heads, context, token_slot, token_pos, scale, window, partial):
            grid_dependency_wait()  # pdl.py: before any global read or write
            if min_blocks < 0:  # never: puts min_blocks (launch bounds) into numba's cache key as a closure value
                return
            t, kv_head, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
            first, end, num_splits = window_split(token_pos[t], window, split)
            if split >= num_splits:
                return  # the whole block
            part_of_split(q, k_words, v_words, num_kv_heads, context, token_slot, scale, partial, t, kv_head, split,
                          first, end)

        return attention_split

    @bounded_kernel(num_threads, min_blocks)
    def attention_split_merge(q, k_words, v_words, num_kv_heads, context, token_slot, token_pos, scale, window,
                              partial, done, out):
        grid_dependency_wait()  # pdl.py: before any global read or write
        if min_blocks < 0:  # never: puts min_blocks (launch bounds) into numba's cache key as a closure value
            return
        t, kv_head, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        first, end, num_splits = window_split(token_pos[t], window, split)
        if split >= num_splits:
            return  # the whole block
        part_of_split(q, k_words, v_words, num_kv_heads, context, token_slot, scale, partial, t, kv_head, split,
                      first, end)
        if is_last_of(done, t * num_kv_heads + kv_head, num_splits):
            if cuda.threadIdx.x == 0:
                done[t * num_kv_heads + kv_head] = 0  # for the next launch (a graph replays this one)
            cuda.threadfence()  # the other blocks' partials, seen through their fence and the counter
            merge_group(t, kv_head, num_splits, partial, out)

    return attention_split_merge


@functools.cache
def merger(head_dim: int, group: int, num_threads: int, cap: int, chunk_splits: int):
    """merge_group(t, kv_head, num_splits, partial, out): out[t, h] of the ``group`` heads h of
    ``kv_head`` from their num_splits (<= ``cap``) splits' partials, by a block of ``num_threads``
    threads (a multiple of 32), as merge_splits did before the fifteenth session: the same expressions
    in the same order (the peak, then the splits' weights and sums added in split order), so the same
    bits. Its loads in flight: a warp a head loads every split's max at once (lanes over the
    splits), the peak by a butterfly (max: any order), the weights into shared memory (group x cap
    floats: 8 KiB at a group of 8 and 256 splits, beside the decode kernel's 33 KiB); then each thread
    loads its outputs' values and sums of chunk_splits splits at once: 1 + num_splits / chunk_splits
    round trips to L2 (the merge before: 2 num_splits / chunk_splits)."""
    outputs = group * head_dim
    per_thread = -(-outputs // num_threads)
    loads_size = per_thread * chunk_splits
    per_lane = -(-cap // WARP)  # splits a lane's max and sum loads
    num_warps = num_threads // WARP

    @device_with_shared
    def merge_group(t, kv_head, num_splits, partial, out):
        weights = cuda.shared.array((group, cap), float32)
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        maxes = cuda.local.array(per_lane, float32)
        for j in range(warp, group, num_warps):  # warp-uniform: the butterfly's lanes all take part
            head = kv_head * group + j
            for i in range(per_lane):  # every load first
                maxes[i] = partial[t, head, min(lane + i * WARP, num_splits - 1), head_dim]
            peak = NEG_INF
            for i in range(per_lane):
                peak = max(peak, maxes[i])
            offset = WARP // 2
            while offset > 0:
                peak = max(peak, xor_of(peak, offset))
                offset //= 2
            for i in range(per_lane):
                s = lane + i * WARP
                if s < num_splits:
                    weights[j, s] = math.exp(maxes[i] - peak)
        cuda.syncthreads()
        values = cuda.local.array(loads_size, float32)
        sums = cuda.local.array(loads_size, float32)  # the same in a warp's lanes (one head): a broadcast
        total = cuda.local.array(per_thread, float32)
        value = cuda.local.array(per_thread, float32)
        for k in range(per_thread):
            total[k] = float32(0.0)
            value[k] = float32(0.0)
        for s0 in range(0, num_splits, chunk_splits):
            for k in range(per_thread):  # every load first
                e = min(tid + k * num_threads, outputs - 1)
                head, d = kv_head * group + e // head_dim, e % head_dim
                for c in range(chunk_splits):
                    s = min(s0 + c, num_splits - 1)
                    values[k * chunk_splits + c] = partial[t, head, s, d]
                    sums[k * chunk_splits + c] = partial[t, head, s, head_dim + 1]
            for k in range(per_thread):
                j = min(tid + k * num_threads, outputs - 1) // head_dim
                for c in range(chunk_splits):
                    if s0 + c < num_splits:
                        weight = weights[j, s0 + c]
                        total[k] += sums[k * chunk_splits + c] * weight
                        value[k] += values[k * chunk_splits + c] * weight
        for k in range(per_thread):
            e = tid + k * num_threads
            if e < outputs:
                out[t, kv_head * group + e // head_dim, e % head_dim] = value[k] / total[k]
        cuda.syncthreads()  # the weights read by all before a next use of the block's shared memory

    return merge_group


@functools.cache
def _peaks_merger(head_dim, group, num_threads, chunk_splits):
    """The merge of the thirteenth session (WIDE_MERGE off): the peaks in a pass of their own, a round
    trip to L2 for every chunk_splits splits, twice."""
    outputs = group * head_dim  # a merging block's outputs: its kv head's group of heads
    per_thread = -(-outputs // num_threads)
    loads_size = per_thread * chunk_splits  # a merging thread's loads of a round

    @device
    def merge_group(t, kv_head, num_splits, partial, out):
        # out[t, h, d] for the group's heads as merge_splits computes it (the same expressions in the
        # same order); each thread's outputs' partials of chunk_splits splits are loaded together
        tid = cuda.threadIdx.x
        maxes = cuda.local.array(loads_size, float32)
        sums = cuda.local.array(loads_size, float32)
        values = cuda.local.array(loads_size, float32)
        peak = cuda.local.array(per_thread, float32)
        total = cuda.local.array(per_thread, float32)
        value = cuda.local.array(per_thread, float32)
        for k in range(per_thread):
            peak[k] = NEG_INF
            total[k] = float32(0.0)
            value[k] = float32(0.0)
        if num_splits > chunk_splits:  # the peaks first (long contexts); else from the first chunk's loads
            for s0 in range(0, num_splits, chunk_splits):
                for k in range(per_thread):
                    e = min(tid + k * num_threads, outputs - 1)
                    head = kv_head * group + e // head_dim
                    for c in range(chunk_splits):
                        maxes[k * chunk_splits + c] = partial[t, head, min(s0 + c, num_splits - 1), head_dim]
                for k in range(per_thread):
                    for c in range(chunk_splits):
                        peak[k] = max(peak[k], maxes[k * chunk_splits + c])
        for s0 in range(0, num_splits, chunk_splits):
            for k in range(per_thread):  # every load first
                e = min(tid + k * num_threads, outputs - 1)
                head, d = kv_head * group + e // head_dim, e % head_dim
                for c in range(chunk_splits):
                    s = min(s0 + c, num_splits - 1)
                    maxes[k * chunk_splits + c] = partial[t, head, s, head_dim]
                    sums[k * chunk_splits + c] = partial[t, head, s, head_dim + 1]
                    values[k * chunk_splits + c] = partial[t, head, s, d]
            if num_splits <= chunk_splits:
                for k in range(per_thread):
                    for c in range(chunk_splits):
                        peak[k] = max(peak[k], maxes[k * chunk_splits + c])
            for k in range(per_thread):
                for c in range(chunk_splits):
                    if s0 + c < num_splits:
                        weight = math.exp(maxes[k * chunk_splits + c] - peak[k])
                        total[k] += sums[k * chunk_splits + c] * weight
                        value[k] += values[k * chunk_splits + c] * weight
        for k in range(per_thread):
            e = tid + k * num_threads
            if e < outputs:
                out[t, kv_head * group + e // head_dim, e % head_dim] = value[k] / total[k]
    return merge_group


@kernel
def merge_splits_serial(token_pos, window, partial, out):
    # one thread per output (t, h, d): splits combined in order, so the result is deterministic
    # (the merge of the fourteenth session: a round trip to L2 a split; WIDE_MERGE off)
    grid_dependency_wait()  # pdl.py: before any global read or write
    num_tokens, num_heads, head_dim = out.shape
    for n in range(cuda.grid(1), num_tokens * num_heads * head_dim, cuda.gridsize(1)):
        t = n // (num_heads * head_dim)
        h = (n // head_dim) % num_heads
        d = n % head_dim
        num_splits = window_split(token_pos[t], window, 0)[2]
        peak = NEG_INF
        for s in range(num_splits):
            peak = max(peak, partial[t, h, s, head_dim])
        total = float32(0.0)
        value = float32(0.0)
        for s in range(num_splits):
            weight = math.exp(partial[t, h, s, head_dim] - peak)
            total += partial[t, h, s, head_dim + 1] * weight
            value += partial[t, h, s, d] * weight
        out[t, h, d] = value / total


@functools.cache
def _merge_splits(decode_splits: int, split_positions: int, head_dim: int, chunk_splits: int):
    window_split = splitter(decode_splits, split_positions)[1]
    merge_head = merger(head_dim, 1, MERGE_THREADS, decode_splits, chunk_splits)

    @kernel
    def merge_splits_wide(token_pos, window, partial, out):
        grid_dependency_wait()  # pdl.py: before any global read or write
        t, h = cuda.blockIdx.x, cuda.blockIdx.y
        merge_head(t, h, window_split(token_pos[t], window, 0)[2], partial, out)

    return merge_splits_wide


def merge_splits(head_dim: int, split_positions: int = 0):
    """The kernel that merges the splits apart (no counters), launched on a grid of (T, H) blocks of
    MERGE_THREADS: a block per (token, head), merger's order (the last split block's merge's bits), for
    splits of at least ``split_positions`` (0: SPLIT_POSITIONS); WIDE_MERGE off: the serial kernel, a
    thread an output (grid: blocks over T * H * hd), of SPLIT_POSITIONS only."""
    if WIDE_MERGE:
        return _merge_splits(int(DECODE_SPLITS), int(split_positions or SPLIT_POSITIONS), head_dim,
                             int(MERGE_APART_SPLITS))
    return merge_splits_serial
