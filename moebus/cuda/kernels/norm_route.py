"""Decode's MLP entry in one launch, ``norm_route``: the residual add and the MLP norm
(fused.add_rmsnorm), the router's logits, top-k + softmax (moe.topk_row) and the pair tables (as
routing.route_pairs), where four launches took ~22 us on an H200 at batch 1 (6.6 + 8.4 + 3.8 + 3.1).
A block per token does the first three for its token; the block that finishes last (a counter in
device memory, reset by that block, so a captured graph replays it) sorts the step's pairs.

Two kernels: the in-flight one (bf16 / f16 routers read wide, the default) issues a thread's share of
the router's rows as raw words before the norm, so the router costs one round trip to memory. Given a
logits scratch (the backend's step pool) and at most SPREAD_TOKENS tokens, it spreads a token's
router rows over ROUTER_BLOCKS blocks, each redoing the token's norm and writing its experts'
logits; the grid's last block does every token's top-k and the pairs (routing.spread_tail), with the
same bits (32 experts on an H200: 9.36 -> 7.61 us at batch 1, 12.74 -> 11.72 at batch 8, 16 blocks).
With at most 32 experts the tail goes by ranks (routing.ranks_tail, one_token_tail for one token)
instead of top_k argmaxes in turn and the pairs re-read through L2. The one-block kernel, for the
other routers, loads them in rounds of ROUTER_UNROLL words a lane after the norm and re-reads h from
memory (15.8 us). ROUTER_EARLY (seventeenth session, route17): the in-flight kernel's first router words and
the norm's weights are loaded before the PDL wait.

Shapes: T tokens, A active experts per token, P = T * A pairs, E experts, D hidden."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import (FULL_MASK, MAX_WARPS, SIMULATOR, WARP, block_sum, cuda, device,
                                        float32, int32, kernel, threads, uint64, warp_sum)
from moebus.cuda.kernels.pdl import grid_dependency_wait, prefetch_rows
from moebus.cuda.kernels.fused import add_rmsnorm_ref, normed_store, row_values
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, ceil_div, require
from moebus.cuda.kernels.linear import accumulate, linear_ref
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.loads import WORD, can_read_wide, chunk_reader, reader_view, storage_of
from moebus.cuda.kernels.moe import topk_row, topk_softmax_ref
from moebus.cuda.kernels.routing import (MAX_EXPERTS, MAX_PAIRS, SPREAD_EXPERTS, SPREAD_TOKENS, is_last_block,
                                         ARGMAXES, ONE_TOKEN_RANKS, RANKS, one_token_tail, ranks_tail, route_pairs_ref,
                                         sort_pairs, spread_tail)

ROUTE_THREADS = 512  # 16 warps: up to 128 registers a thread
ROUTER_UNROLL = 8  # router words each lane loads before their first use (the one-block kernel)
ROUTER_IN_FLIGHT = True  # the in-flight kernel where it applies (measured: decode7_2.sh, docs/performance.md)
ROUTER_WORDS_IN_FLIGHT = 32  # raw 8-byte router words a thread holds a round (64 registers)
ROUTER_RANKS = True  # <= 32 experts: top-k and pairs by ranks (routing.ranks_tail), one token, or few spread
ONE_TOKEN_TAIL = True  # ...with routing.one_token_tail for one token (decode11: ranks_tail took 1.35 us a layer more)
ROUTER_BLOCKS = 16  # blocks a token that share the router's rows (the in-flight kernel, given a scratch; decode10.sh)
# pdl.py: the in-flight kernel's warps ask L2 for the block's router rows before the wait (the router never
# changes within a step; behind a programmatic edge the bytes come while the o projection ends). Off until
# measured (sixteenth session, fuse16.sh).
ROUTER_PREFETCH = False
# ROUTER_EARLY: round 0's router words and the norm's weights issued before the PDL wait (weights: no kernel
# of the step writes them), so behind a programmatic edge their HBM round trip overlaps the o projection's end.
# Same bits. H200, 48 x 32 bf16, b1 (route17.sh, seventeenth session's call A): 324.7 tok/s against 322.5 /
# 322.4 (defaults before and after). route17's other two switches (warp 0 alone ending a spread step with a
# lighter fence; the warp partials summed unrolled) were slower, true durations 8.9 and 9.2 us against 8.3,
# and were removed after that call (git show 533871b:moebus/cuda/kernels/routing.py has warp_tail).
ROUTER_EARLY = True
TAIL_PARTS = 8  # route_tail: threads a column of partials (the tiles j, j + 8, ... each, then the 8 in order)
TAIL_COLUMNS = MAX_EXPERTS + 1  # route_tail: a column an expert, then the squares


def norm_route_ref(x, y, norm_weight, eps: float, router, top_k: int, normalize: bool, table, layer_row: int):
    # -> (total, h, ids, weights, pair_token, pair_slot, pair_out): total = x + y, h its rmsnorm,
    # the router's top-k of h and the pair tables of route_pairs_ref
    total, h = add_rmsnorm_ref(x, y, norm_weight, eps)
    ids, weights = topk_softmax_ref(linear_ref(h, router), top_k, normalize)
    return (total, h, ids, weights) + tuple(route_pairs_ref(ids, table, layer_row))


HALF_WARP = WARP // 2

if SIMULATOR:
    @device
    def half_warp_sum_scatter(values):
        """The warp's sum of values[lane % 16] (values: 16 floats a lane), by warp_sum in turn."""
        lane = cuda.threadIdx.x % WARP
        mine = float32(0.0)
        for i in range(HALF_WARP):
            total = warp_sum(values[i])
            if i == lane % HALF_WARP:
                mine = total
        return mine
else:
    @device
    def _scatter_level(values, upper, offset):
        # values[0:2 offset] -> values[0:offset]: the lower half of the indices kept by lanes without
        # the offset's bit, the upper half by those with it, each added to its partner lane's
        for i in range(offset):
            send = values[i] if upper else values[i + offset]
            keep = values[i + offset] if upper else values[i]
            values[i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, offset)

    @device
    def half_warp_sum_scatter(values):
        """The warp's sum of values[lane % 16] (values: 16 floats a lane, overwritten): a
        reduce-scatter butterfly over the half-warp, then the two halves added, 16 shuffles where
        16 warp_sums take 80."""
        lane = cuda.threadIdx.x % WARP
        _scatter_level(values, (lane & 8) != 0, 8)
        _scatter_level(values, (lane & 4) != 0, 4)
        _scatter_level(values, (lane & 2) != 0, 2)
        _scatter_level(values, (lane & 1) != 0, 1)
        return values[0] + cuda.shfl_xor_sync(FULL_MASK, values[0], 16)


@functools.cache
def _norm_route_kernel(norm_storage: str, router_storage: str, wide: bool, per_thread: int, per_lane: int,
                       top_k: int):
    store_normed = normed_store(norm_storage, per_thread)
    load_row = row_values(per_thread)
    row_topk = topk_row(per_lane)
    read_weight, width = chunk_reader(router_storage, wide)
    read_h, _ = chunk_reader("f32", wide)

    @kernel
    def norm_route_rows(x, y, norm_weight, eps, router, num_words, h_view, normalize, table, layer_row, done,
                        total, h, ids, weights, pair_token, pair_slot, pair_out):
        grid_dependency_wait()  # pdl.py: before any global read or write
        t = cuda.blockIdx.x  # one block per token, every block real
        num_tokens, dim = x.shape
        num_experts = router.shape[0]
        tid = cuda.threadIdx.x
        lane, warp, warps = tid % WARP, tid // WARP, cuda.blockDim.x // WARP
        # 1. total = x + y and h = rmsnorm(total), as add_rmsnorm_rows
        values = cuda.local.array(per_thread, float32)
        square_sum = load_row(x, y, t, dim, values)
        store_normed(values, norm_weight, block_sum(square_sum), dim, eps, t, total, h)
        cuda.syncthreads()  # h[t] is read back below by other threads of the block
        # 2. the router's logits of token t: a warp per expert, lane l sums words l, l + 32, ...
        logits = cuda.shared.array((1, MAX_EXPERTS), float32)
        w_buf = cuda.local.array((ROUTER_UNROLL, width), float32)
        h_buf = cuda.local.array(width, float32)
        for start in range(0, num_experts, warps):  # same trip count in every warp
            e = min(start + warp, num_experts - 1)
            acc = float32(0.0)
            for base in range(lane, num_words, WARP * ROUTER_UNROLL):
                for u in range(ROUTER_UNROLL):
                    read_weight(router, e, min(base + u * WARP, num_words - 1), w_buf[u])
                for u in range(ROUTER_UNROLL):
                    word = base + u * WARP
                    if word < num_words:
                        read_h(h_view, t, word, h_buf)
                        acc = accumulate(acc, h_buf, w_buf[u], width)
            acc = warp_sum(acc)
            if lane == 0 and start + warp < num_experts:
                logits[0, e] = acc
        cuda.syncthreads()
        # 3. top-k + softmax of token t by warp 0; 4. the last block to finish sorts every token's pairs
        if warp == 0:
            row_topk(logits, 0, num_experts, top_k, normalize, ids, weights, t, lane == 0)
        if not is_last_block(done, num_tokens):
            return  # the whole block
        sort_pairs(ids, table[layer_row], num_tokens, top_k, pair_token, pair_slot, pair_out)
        if tid == 0:
            done[0] = 0  # for the next launch (a graph replays this one)

    return norm_route_rows


@device
def _round_words(router, raw, first, hi, g, s, span, num_words):
    # a round's raw router words of this thread: expert first + g * per_round + k (clamped to hi - 1), words
    # s, s + span, ... of its row
    per_round, words = raw.shape
    for k in range(per_round):
        e = min(first + g * per_round + k, hi - 1)
        for i in range(words):
            raw[k, i] = router[e, min(s + i * span, num_words - 1)]


@functools.cache
def _inflight_route_kernel(norm_storage: str, router_storage: str, words: int, rounds: int, per_round: int,
                           groups: int, per_lane: int, top_k: int, by_ranks: int, spread: int, prefetch: bool = False,
                           early: bool = False):
    """norm_route with the router's rows in flight before the norm (ROUTER_IN_FLIGHT): the block's
    threads form ``groups`` groups of ``span`` threads; thread s of group g holds the row's 8-byte
    words s, s + span, ... (``words`` of them) and loads, for each of its ``per_round`` experts of a
    round, those words of the expert's router row as raw bits first; then x + y, the norm, and each
    expert's dot product from registers. ``spread`` blocks a token, block (t, part) the experts
    [part * share, (part + 1) * share); with one, the logits stay in shared memory, a step of one
    token skips the last-block counter (its block is the last), and with ``by_ranks`` (at most 32
    experts; routing.RANKS or ONE_TOKEN_RANKS) ends with ranks_tail or one_token_tail; with several,
    they go to ``scratch`` and the last block of the grid finishes (spread_tail). An expert's logit
    has the same bits whatever the spread: its group's threads and their order are the same. ``prefetch``
    (ROUTER_PREFETCH): the block's warps ask L2 for its experts' router rows (a warp a row) before the wait.
    ``early`` (ROUTER_EARLY): round 0's router words and the norm's weights loaded before the wait (weights:
    no kernel of the step writes them)."""
    read_norm, _ = chunk_reader(norm_storage, True)
    read_row, _ = chunk_reader("f32", True)
    word_values = WORD[router_storage]
    row_topk = topk_row(per_lane)
    finish = spread_tail(per_lane, by_ranks)

    @kernel
    def inflight_route_rows(x, y, norm_weight, eps, router, num_words, table, layer_row, done, normalize, share,
                            scratch, total, h, ids, weights, pair_token, pair_slot, pair_out):
        if prefetch:  # the block's rows, a warp a row in turn; 16 words = a 128-byte line
            for r in range(cuda.threadIdx.x // WARP, share, cuda.blockDim.x // WARP):
                prefetch_rows(router, (cuda.blockIdx.x % spread) * share + r, 1, len(router), 0, num_words, 16)
        t, part = cuda.blockIdx.x // spread, cuda.blockIdx.x % spread  # every block real
        num_experts = router.shape[0]
        lo = part * share  # this block's experts: lo .. hi - 1
        hi = min(lo + share, num_experts)
        tid = cuda.threadIdx.x
        span = cuda.blockDim.x // groups
        g, s = tid // span, tid % span
        raw = cuda.local.array((per_round, words), uint64)
        scale = cuda.local.array((words, 4), float32)  # the norm's weights, loaded before they are needed
        if early:  # weights, which no kernel of the step writes: out before the wait (ROUTER_EARLY)
            _round_words(router, raw, lo, hi, g, s, span, num_words)
            for i in range(words):
                read_norm(norm_weight, 0, min(s + i * span, num_words - 1), scale[i])
        grid_dependency_wait()  # pdl.py: before any read of what the step writes (weights aside, above)
        num_tokens, dim = total.shape
        lane, warp = tid % WARP, tid // WARP
        if not early:
            _round_words(router, raw, lo, hi, g, s, span, num_words)  # round 0 out first: nothing below waits on it
        places = cuda.shared.array(MAX_EXPERTS, int32)  # the table's row, for the pairs at the end
        for e in range(tid, num_experts, cuda.blockDim.x):
            places[e] = table[layer_row, e]
        # 1. total = x + y, h = rmsnorm(total); group 0 counts the squares, part 0's group 0 stores
        values = cuda.local.array((words, 4), float32)
        x_buf = cuda.local.array(4, float32)
        y_buf = cuda.local.array(4, float32)
        square_sum = float32(0.0)
        for i in range(words):
            word = min(s + i * span, num_words - 1)
            if not early:
                read_norm(norm_weight, 0, word, scale[i])
            read_row(x, t, word, x_buf)
            read_row(y, t, word, y_buf)
            for c in range(4):
                values[i, c] = x_buf[c] + y_buf[c]
                if g == 0 and s + i * span < num_words:
                    square_sum += values[i, c] * values[i, c]
                    if part == 0:
                        total[t, 4 * word + c] = values[i, c]
        inv_rms = float32(1.0) / math.sqrt(block_sum(square_sum) / float32(dim) + eps)
        for i in range(words):
            word = min(s + i * span, num_words - 1)
            for c in range(4):
                values[i, c] = scale[i, c] * (values[i, c] * inv_rms)  # fused.normed_store's order
                if part == 0 and g == 0 and s + i * span < num_words:
                    h[t, 4 * word + c] = values[i, c]
        # 2. the logits, a round of groups x per_round experts at a time
        partial = cuda.shared.array((MAX_WARPS, per_round), float32)
        logits = cuda.shared.array((1, MAX_EXPERTS), float32)
        group_warps = span // WARP
        sums = cuda.local.array(HALF_WARP, float32)
        for r in range(rounds):
            first = lo + r * groups * per_round
            if r > 0:
                _round_words(router, raw, first, hi, g, s, span, num_words)
            for half in range(0, per_round, HALF_WARP):  # 16 experts at a time: fewer registers live
                for k in range(HALF_WARP):  # expert half + k of the round's: this thread's share of its logit
                    sums[k] = float32(0.0)
                    if half + k < per_round:
                        for i in range(words):
                            if s + i * span < num_words:
                                word_values(raw[half + k, i], x_buf)
                                for c in range(4):
                                    sums[k] += values[i, c] * x_buf[c]
                logit = half_warp_sum_scatter(sums)  # the warp's sum of expert half + lane % 16's
                if lane < HALF_WARP and half + lane < per_round:
                    partial[warp, half + lane] = logit
            cuda.syncthreads()
            if tid < groups * per_round:
                gg, k = tid // per_round, tid % per_round
                logit = float32(0.0)
                for w in range(group_warps):  # the group's warps in order
                    logit += partial[gg * group_warps + w, k]
                if first + tid < hi:
                    if spread == 1:
                        logits[0, first + tid] = logit
                    else:
                        scratch[t, first + tid] = logit
            cuda.syncthreads()
        if spread > 1:  # 3-4. the grid's last block: every token's top-k and the pairs
            finish(scratch, num_experts, top_k, normalize, places, done, ids, weights, pair_token, pair_slot,
                   pair_out)
            return
        # 3. top-k + softmax by warp 0; 4. the last block sorts every token's pairs
        if by_ranks == ONE_TOKEN_RANKS and num_tokens == 1:
            one_token_tail(logits, num_experts, top_k, normalize, places, ids, weights, pair_token, pair_slot,
                           pair_out)
            return
        if by_ranks and num_tokens == 1:
            ranks_tail(logits, 1, num_experts, top_k, normalize, places, ids, weights, pair_token, pair_slot,
                       pair_out)
            return
        if warp == 0:
            row_topk(logits, 0, num_experts, top_k, normalize, ids, weights, t, lane == 0)
        if num_tokens > 1 and not is_last_block(done, num_tokens):
            return  # the whole block
        cuda.syncthreads()  # a single token: warp 0's ids written
        sort_pairs(ids, places, num_tokens, top_k, pair_token, pair_slot, pair_out)
        if tid == 0 and num_tokens > 1:
            done[0] = 0  # for the next launch (a graph replays this one)

    return inflight_route_rows


def inflight_shape(dim: int, num_experts: int, block: int) -> tuple[int, int, int, int] | None:
    """(words a thread, rounds, experts a round a thread, groups) of the in-flight router kernel for
    rows of ``dim`` over a block of ``block`` threads: a group's threads cover a row's 8-byte words,
    ROUTER_WORDS_IN_FLIGHT raw words a thread a round; None where the row is too long for it."""
    num_words = dim // 4
    words = ceil_div(num_words, block)
    if words > ROUTER_WORDS_IN_FLIGHT:
        return None
    span = WARP
    while span * words < num_words:
        span *= 2
    groups = block // span
    per_round = min(ROUTER_WORDS_IN_FLIGHT // words, ceil_div(num_experts, groups))
    return words, ceil_div(num_experts, groups * per_round), per_round, groups


def router_share(num_tokens: int, num_experts: int, has_scratch: bool) -> int:
    """Experts a block of the in-flight kernel takes: all of them (one block a token), or with a
    logits scratch and at most SPREAD_TOKENS tokens and SPREAD_EXPERTS experts, the router's rows
    over ROUTER_BLOCKS blocks a token."""
    if not has_scratch or num_tokens > SPREAD_TOKENS or num_experts > SPREAD_EXPERTS:
        return num_experts
    return ceil_div(num_experts, max(1, min(ROUTER_BLOCKS, num_experts)))


def tail_by_ranks(num_experts: int) -> int:
    """The in-flight kernel's tail (routing.ARGMAXES / RANKS / ONE_TOKEN_RANKS) by the switches."""
    if not ROUTER_RANKS or num_experts > WARP:
        return ARGMAXES
    return ONE_TOKEN_RANKS if ONE_TOKEN_TAIL else RANKS


def norm_route_cuda(x, y, norm_weight, eps: float, router, top_k: int, normalize: bool, table, layer_row: int, done,
                    total, h, ids, weights, pair_token, pair_slot, pair_out, stream=0, scratch=None):
    """norm_route_ref into device arrays: total, h (T, D) float32; ids (T, A) int32, weights (T, A)
    float32; pair tables (P,) int32. ``done``: a (1,) int32 device counter, zero between launches.
    ``scratch``: a (T, E) float32 device array for the logits, which lets the in-flight kernel
    spread a token's router rows over ROUTER_BLOCKS blocks (router_share); its contents are
    overwritten, and it must keep its address where a graph replays the launch."""
    num_tokens, dim = x.shape
    num_experts = router.shape[0]
    for name, a in (("x", x), ("y", y), ("total", total), ("h", h)):
        require(name, a, np.float32, shape=(num_tokens, dim))
    require("norm_weight", norm_weight, WEIGHT_DTYPES, shape=(dim,))
    require("router", router, WEIGHT_DTYPES, shape=(None, dim))
    require("table", table, np.int32, ndim=2)
    require("done", done, np.int32, shape=(1,))
    require("ids", ids, np.int32, shape=(num_tokens, top_k))
    require("weights", weights, np.float32, shape=(num_tokens, top_k))
    for name, out in (("pair_token", pair_token), ("pair_slot", pair_slot), ("pair_out", pair_out)):
        require(name, out, np.int32, shape=(num_tokens * top_k,))
    if not 0 < top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} of {num_experts} experts: 1 <= top_k <= experts <= {MAX_EXPERTS}")
    if num_tokens * top_k > MAX_PAIRS:
        raise ValueError(f"{num_tokens} tokens x top {top_k}: more than {MAX_PAIRS} pairs in one step")
    if table.shape[1] != num_experts or not 0 <= layer_row < table.shape[0]:
        raise ValueError(f"layer row {layer_row} of a {tuple(table.shape)} table for {num_experts} experts")
    if num_tokens == 0:
        return total, h, ids, weights, pair_token, pair_slot, pair_out
    block = threads(ROUTE_THREADS)
    if ROUTER_IN_FLIGHT and inflight_shape(dim, num_experts, block) is not None and storage_of(router) in WORD \
            and all(can_read_wide(a) for a in (x, y, norm_weight, router)):
        share = router_share(num_tokens, num_experts, scratch is not None)
        spread = ceil_div(num_experts, share)
        if spread > 1:
            require("scratch", scratch, np.float32, shape=(num_tokens, num_experts))
        kernel = _inflight_route_kernel(storage_of(norm_weight), storage_of(router), *inflight_shape(dim, share, block),
                                        ceil_div(num_experts, WARP), int(top_k), tail_by_ranks(num_experts), spread,
                                        ROUTER_PREFETCH, ROUTER_EARLY)
        kernel[num_tokens * spread, block, stream](
            reader_view(x, True), reader_view(y, True), reader_view(norm_weight, True), np.float32(eps),
            reader_view(router, True), dim // 4, table, int(layer_row), done, bool(normalize), share,
            scratch if spread > 1 else total, total, h, ids, weights, pair_token, pair_slot, pair_out)
        return total, h, ids, weights, pair_token, pair_slot, pair_out
    wide = can_read_wide(router) and can_read_wide(h)
    kernel = _norm_route_kernel(storage_of(norm_weight), storage_of(router), wide, ceil_div(dim, block),
                                ceil_div(num_experts, WARP), int(top_k))
    kernel[num_tokens, block, stream](
        x, y, reader_view(norm_weight, wide=False), np.float32(eps), reader_view(router, wide),
        dim // 4 if wide else dim, reader_view(h, wide), bool(normalize), table, int(layer_row), done,
        total, h, ids, weights, pair_token, pair_slot, pair_out)
    return total, h, ids, weights, pair_token, pair_slot, pair_out


@functools.cache
def _route_tail_kernel(norm_storage: str, per_lane: int, top_k: int, by_ranks: int, words: int, passes: int,
                       loads: int):
    """norm_route's end after the o projection's ROUTE entry (linear_quant_mma.launch_route), one token, one block:
    the tiles' partials summed in a fixed order (TAIL_PARTS threads a column, each the tiles j, j + TAIL_PARTS, ...,
    then their sums in order), the norm's 1 / rms from the squares, the logits scaled by it, h = norm_weight * (total
    * 1 / rms) (fused.normed_store's order), then the in-flight kernel's one-token end (one_token_tail, ranks_tail or
    topk_row + sort_pairs). Every global read is issued before the first sum: the norm's weights (``words`` words a
    thread) before the PDL wait (weights, as ROUTER_EARLY), then ``passes`` x ``loads`` partials and the total's
    words a thread, so the block waits on one round trip to L2 (call B: 6.8 us with the partials read in a loop of
    dependent loads)."""
    read_norm, _ = chunk_reader(norm_storage, True)
    read_row, _ = chunk_reader("f32", True)
    row_topk = topk_row(per_lane)

    @kernel
    def route_tail(partial, total, norm_weight, eps, num_words, table, layer_row, normalize, h, ids, weights,
                   pair_token, pair_slot, pair_out):
        tid, threads_ = cuda.threadIdx.x, cuda.blockDim.x
        scale = cuda.local.array((words, 4), float32)
        for i in range(words):  # weights, which no kernel of the step writes: before the wait
            read_norm(norm_weight, 0, min(tid + i * threads_, num_words - 1), scale[i])
        grid_dependency_wait()  # pdl.py: before any read of what the step writes (weights aside, above)
        tiles, columns = partial.shape
        num_experts, dim = columns - 1, 4 * num_words
        parts = cuda.local.array((passes, loads), float32)
        for q in range(passes):
            c, j = (tid + q * threads_) // TAIL_PARTS, (tid + q * threads_) % TAIL_PARTS
            for k in range(loads):
                tile = j + k * TAIL_PARTS
                parts[q, k] = partial[min(tile, tiles - 1), min(c, columns - 1)]
        values = cuda.local.array((words, 4), float32)
        for i in range(words):
            read_row(total, 0, min(tid + i * threads_, num_words - 1), values[i])
        places = cuda.shared.array(MAX_EXPERTS, int32)
        for e in range(tid, num_experts, threads_):
            places[e] = table[layer_row, e]
        sums = cuda.shared.array((TAIL_PARTS, TAIL_COLUMNS), float32)
        for q in range(passes):
            c, j = (tid + q * threads_) // TAIL_PARTS, (tid + q * threads_) % TAIL_PARTS
            part = float32(0.0)
            for k in range(loads):
                if j + k * TAIL_PARTS < tiles:
                    part += parts[q, k]
            if c < columns:
                sums[j, c] = part
        cuda.syncthreads()
        square_sum = float32(0.0)
        for j in range(TAIL_PARTS):
            square_sum += sums[j, num_experts]
        inv_rms = float32(1.0) / math.sqrt(square_sum / float32(dim) + eps)
        logits = cuda.shared.array((1, MAX_EXPERTS), float32)
        for e in range(tid, num_experts, threads_):
            logit = float32(0.0)
            for j in range(TAIL_PARTS):
                logit += sums[j, e]
            logits[0, e] = logit * inv_rms
        for i in range(words):
            word = tid + i * threads_
            if word < num_words:
                for c in range(4):
                    h[0, 4 * word + c] = scale[i, c] * (values[i, c] * inv_rms)  # fused.normed_store's order
        cuda.syncthreads()  # the logits
        if by_ranks == ONE_TOKEN_RANKS:
            one_token_tail(logits, num_experts, top_k, normalize, places, ids, weights, pair_token, pair_slot,
                           pair_out)
            return
        if by_ranks:
            ranks_tail(logits, 1, num_experts, top_k, normalize, places, ids, weights, pair_token, pair_slot, pair_out)
            return
        if tid < WARP:
            row_topk(logits, 0, num_experts, top_k, normalize, ids, weights, 0, tid == 0)
        cuda.syncthreads()  # warp 0's ids written
        sort_pairs(ids, places, 1, top_k, pair_token, pair_slot, pair_out)

    return route_tail


def route_tail_ref(partial, total, norm_weight, eps: float, top_k: int, normalize: bool, table, layer_row: int):
    """route_tail's arithmetic in numpy: -> (h, ids, weights, pair_token, pair_slot, pair_out) of one token from the
    ROUTE entry's partials (moe_quant_mma_ref.route_partials_ref) and total (1, D)."""
    partial = np.asarray(partial, np.float32)
    tiles, columns = partial.shape
    sums = np.zeros((TAIL_PARTS, columns), np.float32)
    for j in range(TAIL_PARTS):
        for tile in range(j, tiles, TAIL_PARTS):
            sums[j] += partial[tile]
    total_sums = np.zeros(columns, np.float32)
    for j in range(TAIL_PARTS):
        total_sums += sums[j]
    dim = total.shape[1]
    inv_rms = np.float32(1.0) / np.sqrt(total_sums[-1] / np.float32(dim) + np.float32(eps), dtype=np.float32)
    h = to_f32(norm_weight)[None, :] * (np.asarray(total, np.float32) * inv_rms)
    ids, weights = topk_softmax_ref(total_sums[None, :-1] * inv_rms, top_k, normalize)
    return (h.astype(np.float32), ids, weights) + tuple(route_pairs_ref(ids, table, layer_row))


def route_tail_cuda(partial, total, norm_weight, eps: float, top_k: int, normalize: bool, table, layer_row: int,
                    h, ids, weights, pair_token, pair_slot, pair_out, stream=0):
    """route_tail_ref into device arrays (one block): partial (tiles, E + 1), total and h (1, D) float32, ids and
    weights (1, top_k), the pair tables (top_k,) int32."""
    num_experts, dim = partial.shape[1] - 1, total.shape[1]
    require("partial", partial, np.float32, ndim=2)
    for name, a in (("total", total), ("h", h)):
        require(name, a, np.float32, shape=(1, dim))
    require("norm_weight", norm_weight, WEIGHT_DTYPES, shape=(dim,))
    require("ids", ids, np.int32, shape=(1, top_k))
    require("weights", weights, np.float32, shape=(1, top_k))
    for name, out in (("pair_token", pair_token), ("pair_slot", pair_slot), ("pair_out", pair_out)):
        require(name, out, np.int32, shape=(top_k,))
    if not 0 < top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} of {num_experts} experts: 1 <= top_k <= experts <= {MAX_EXPERTS}")
    if table.shape[1] != num_experts or not 0 <= layer_row < table.shape[0]:
        raise ValueError(f"layer row {layer_row} of a {tuple(table.shape)} table for {num_experts} experts")
    if dim % 4 or not all(can_read_wide(a) for a in (total, norm_weight)):
        raise ValueError(f"route_tail reads total and the norm weight 4 values a load: D {dim}")
    block = threads(ROUTE_THREADS)
    kernel = _route_tail_kernel(storage_of(norm_weight), ceil_div(num_experts, WARP), int(top_k),
                                tail_by_ranks(num_experts), ceil_div(dim // 4, block),
                                ceil_div((num_experts + 1) * TAIL_PARTS, block), ceil_div(partial.shape[0], TAIL_PARTS))
    kernel[1, block, stream](
        partial, reader_view(total, True), reader_view(norm_weight, True), np.float32(eps), dim // 4, table,
        int(layer_row), bool(normalize), h, ids, weights, pair_token, pair_slot, pair_out)
    return h, ids, weights, pair_token, pair_slot, pair_out
