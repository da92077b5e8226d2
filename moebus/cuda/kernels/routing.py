"""Routing on the device: from the router's choices to the expert kernels' pair tables without a
host round trip. A *placement table* (L, E) int32 says where each expert of each MoE layer lives
now: ``slot >= 0`` is an arena slot; ``-1 - row`` means row ``row`` of the host store, which on
cuda is mapped pinned memory that kernels read straight over PCIe (see moe_ffn.py).

``route_pairs`` turns ids (T, A) into the tables ``expert_ffn`` takes: pairs p = t * A + k sorted by
expert (stable, so a pair's place depends only on the step's choices), each with its token, its
placement and its output row. Same-expert pairs end up adjacent, so a run shares one weight read.
Decode's way there is ``norm_route`` (norm_route.py), which sorts its pairs with ``sort_pairs``,
or with ``ranks_tail`` (few tokens, at most 32 experts; ``one_token_tail`` for one); with its router
rows spread over several blocks a token, the last block finishes from the logits the others left in
a scratch (``spread_tail``).

Shapes: T tokens, A active experts per token, P = T * A pairs, L MoE layers, E experts."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import (WARP, blocks, cuda, device_with_shared, float32, int32, kernel, threads,
                                        warp_max, warp_sum)
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import ceil_div, require
from moebus.cuda.kernels.moe import NEG_INF, topk_row

THREADS = 128
MAX_EXPERTS = 1024  # router rows of one layer (norm_route keeps a token's logits in shared memory)
MAX_PAIRS = 1024  # pairs of one step (T * A; a decode step has at most 64 x 8)
SPREAD_TOKENS = 16  # spread_tail, ranks_tail: most tokens, whose logits a block holds in shared memory...
SPREAD_EXPERTS = 128  # ...and most experts
ARGMAXES, RANKS, ONE_TOKEN_RANKS = 0, 1, 2  # a tail's way to top-k and the pairs (norm_route's by_ranks)


def host_placement(row: int) -> int:
    """The table entry of an expert read from host-store row ``row`` (never a slot: negative)."""
    return -1 - int(row)


def route_pairs_ref(ids, table, layer_row: int):
    # ids (T, A) int32, table (L, E) int32 -> pair_token, pair_slot, pair_out (P,) int32,
    # sorted by expert id, ties by pair index
    flat = np.asarray(ids, dtype=np.int32).reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    top_k = ids.shape[1]
    pair_slot = np.asarray(table)[layer_row][flat[order]].astype(np.int32)
    return (order // top_k).astype(np.int32), pair_slot, order


@kernel
def route_flat(ids, table, layer_row, pair_token, pair_slot, pair_out):
    # one thread per pair: its rank among (expert, pair) keys is where it goes; O(P) per thread,
    # which is nothing for decode (P <= a few hundred) and stays correct for any P
    grid_dependency_wait()  # pdl.py: before any global read or write
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    for p in range(cuda.grid(1), num_pairs, cuda.gridsize(1)):
        expert = ids[p // top_k, p % top_k]
        rank = 0
        for q in range(num_pairs):
            other = ids[q // top_k, q % top_k]
            if other < expert or (other == expert and q < p):
                rank += 1
        pair_token[rank] = p // top_k
        pair_slot[rank] = table[layer_row, expert]
        pair_out[rank] = p


def route_pairs_cuda(ids, table, layer_row: int, pair_token, pair_slot, pair_out, stream=0):
    """route_pairs_ref into three (P,) int32 device arrays."""
    require("ids", ids, np.int32, ndim=2)
    require("table", table, np.int32, ndim=2)
    num_pairs = ids.shape[0] * ids.shape[1]
    for name, out in (("pair_token", pair_token), ("pair_slot", pair_slot), ("pair_out", pair_out)):
        require(name, out, np.int32, shape=(num_pairs,))
    if not 0 <= layer_row < table.shape[0]:
        raise ValueError(f"layer row {layer_row} outside the table's {table.shape[0]} rows")
    if num_pairs:
        route_flat[blocks(ceil_div(num_pairs, THREADS)), threads(THREADS), stream](
            ids, table, int(layer_row), pair_token, pair_slot, pair_out)
    return pair_token, pair_slot, pair_out


@device_with_shared
def is_last_block(done, num_blocks):
    """Whether this block is the last of ``num_blocks`` to get here; what every block wrote before
    is visible device-wide to that one (a counter in device memory, reset by the last block)."""
    return is_last_of(done, 0, num_blocks)


@device_with_shared
def is_last_of(done, at, num_blocks):
    """is_last_block with the counter ``done[at]``, for several groups of blocks in one grid."""
    cuda.threadfence()
    cuda.syncthreads()
    flags = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        flags[0] = cuda.atomic.add(done, at, 1)
    cuda.syncthreads()
    return flags[0] == num_blocks - 1


@device_with_shared
def sort_pairs(ids, places, num_tokens, top_k, pair_token, pair_slot, pair_out):
    """The pair tables of a step's ids, by one block: route_flat's ranks; ``places``: the
    placement table's row of the layer."""
    tid, step = cuda.threadIdx.x, cuda.blockDim.x
    num_pairs = num_tokens * top_k
    experts = cuda.shared.array(MAX_PAIRS, int32)
    for p in range(tid, num_pairs, step):  # through L2: other blocks may have written them
        experts[p] = cuda.atomic.add(ids, (p // top_k, p % top_k), 0)
    cuda.syncthreads()
    for p in range(tid, num_pairs, step):
        expert = experts[p]
        rank = 0
        for q in range(num_pairs):
            other = experts[q]
            if other < expert or (other == expert and q < p):
                rank += 1
        pair_token[rank] = p // top_k
        pair_slot[rank] = places[expert]
        pair_out[rank] = p


@device_with_shared
def one_token_tail(logits, num_experts, top_k, normalize, places, ids, weights, pair_token, pair_slot, pair_out):
    """ranks_tail for a step of one token (the same bits, by the same counts): warp 0's softmax and a
    thread an expert, with no count of tokens a chosen expert and one sync less. On an H200 (48 x 32,
    the spread norm_route, 16 blocks, batch 1) the router took 7.61 us a layer with it (decode10.sh)
    and 8.96 with ranks_tail (decode11.sh)."""
    tid = cuda.threadIdx.x
    probs = cuda.shared.array(WARP, float32)
    ranks = cuda.shared.array(WARP, int32)
    by_rank = cuda.shared.array(WARP, float32)  # the chosen probabilities in rank order
    prob = float32(0.0)
    if tid < WARP:  # warp 0, a lane an expert: softmax as topk_row
        prob = logits[0, tid] if tid < num_experts else NEG_INF
        peak = warp_max(prob)
        prob = math.exp(prob - peak)
        total = warp_sum(prob)
        prob = prob / total
        probs[tid] = prob
    cuda.syncthreads()
    if tid < num_experts:
        rank = 0
        for j in range(num_experts):
            if probs[j] > prob or (probs[j] == prob and j < tid):
                rank += 1
        ranks[tid] = rank
        if rank < top_k:
            by_rank[rank] = prob
    cuda.syncthreads()
    if tid < num_experts and ranks[tid] < top_k:
        rank = ranks[tid]
        chosen = float32(0.0)
        for k in range(top_k):  # in rank order, as topk_row adds them
            chosen += by_rank[k]
        place = 0
        for j in range(tid):
            if ranks[j] < top_k:
                place += 1
        ids[0, rank] = tid
        weights[0, rank] = prob / chosen if normalize else prob
        pair_token[place] = 0
        pair_slot[place] = places[tid]
        pair_out[place] = rank  # pair t * A + k of token 0


@device_with_shared
def ranks_tail(logits, num_tokens, num_experts, top_k, normalize, places, ids, weights, pair_token, pair_slot,
               pair_out):
    """Top-k + softmax and the pair tables of a step of at most SPREAD_TOKENS tokens with at most 32
    experts, from their logits (T, E) in shared memory, by the whole block (it syncs): a warp a
    token's softmax (a lane an expert, as topk_row); each expert's rank among its token's
    probabilities (descending, ties to the lower id) a count over the others; a chosen pair's place
    (by expert, then token) the chosen pairs of lower experts plus those of its expert's earlier
    tokens. Where topk_row takes top_k warp argmaxes in turn and sort_pairs re-reads the ids through
    L2 and ranks the pairs: the same bits as those two."""
    tid, step = cuda.threadIdx.x, cuda.blockDim.x
    lane, warp = tid % WARP, tid // WARP
    probs = cuda.shared.array((SPREAD_TOKENS, WARP), float32)
    ranks = cuda.shared.array((SPREAD_TOKENS, WARP), int32)
    by_rank = cuda.shared.array((SPREAD_TOKENS, WARP), float32)  # a token's chosen probabilities in rank order
    counts = cuda.shared.array(WARP, int32)  # tokens that chose each expert
    for t in range(warp, num_tokens, step // WARP):  # the same trip count in a warp's lanes (shuffles)
        prob = logits[t, lane] if lane < num_experts else NEG_INF
        peak = warp_max(prob)
        prob = math.exp(prob - peak)
        total = warp_sum(prob)
        probs[t, lane] = prob / total
    cuda.syncthreads()
    for i in range(tid, num_tokens * WARP, step):
        t, e = i // WARP, i % WARP
        if e < num_experts:
            prob = probs[t, e]
            rank = 0
            for j in range(num_experts):
                if probs[t, j] > prob or (probs[t, j] == prob and j < e):
                    rank += 1
            ranks[t, e] = rank
            if rank < top_k:
                by_rank[t, rank] = prob
    cuda.syncthreads()
    for e in range(tid, num_experts, step):
        count = 0
        for t in range(num_tokens):
            if ranks[t, e] < top_k:
                count += 1
        counts[e] = count
    cuda.syncthreads()
    for i in range(tid, num_tokens * WARP, step):
        t, e = i // WARP, i % WARP
        if e < num_experts and ranks[t, e] < top_k:
            rank = ranks[t, e]
            chosen = float32(0.0)
            for k in range(top_k):  # in rank order, as topk_row adds them
                chosen += by_rank[t, k]
            place = 0
            for j in range(e):
                place += counts[j]
            for u in range(t):
                if ranks[u, e] < top_k:
                    place += 1
            prob = probs[t, e]
            ids[t, rank] = e
            weights[t, rank] = prob / chosen if normalize else prob
            pair_token[place] = t
            pair_slot[place] = places[e]
            pair_out[place] = t * top_k + rank


@functools.cache
def spread_tail(per_lane: int, by_ranks: int):
    """Device function, by every block of a spread norm_route: the last block of the grid to get
    here (the counter ``done``, which it resets) reads every token's logits from ``scratch``
    (T, E) through L2 into shared memory, then does top-k + softmax and the pair tables (``by_ranks``
    RANKS: ranks_tail, ONE_TOKEN_RANKS: one_token_tail for one token and ranks_tail for more, else
    topk_row a warp a token and sort_pairs), as the one-block-a-token kernel's tail does from the
    same logits: the same bits."""
    row_topk = topk_row(per_lane)

    @device_with_shared
    def finish(scratch, num_experts, top_k, normalize, places, done, ids, weights, pair_token, pair_slot, pair_out):
        if not is_last_block(done, cuda.gridDim.x):
            return  # the whole block
        tid, step = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = tid % WARP, tid // WARP
        if tid == 0:
            done[0] = 0  # for the next launch (a graph replays this one); every block has counted
        num_tokens = scratch.shape[0]
        logits = cuda.shared.array((SPREAD_TOKENS, SPREAD_EXPERTS), float32)
        for i in range(tid, num_tokens * num_experts, step):  # other blocks wrote them: through L2
            logits[i // num_experts, i % num_experts] = cuda.atomic.add(
                scratch, (i // num_experts, i % num_experts), float32(0.0))
        cuda.syncthreads()
        if by_ranks == ONE_TOKEN_RANKS and num_tokens == 1:
            one_token_tail(logits, num_experts, top_k, normalize, places, ids, weights, pair_token, pair_slot,
                           pair_out)
            return
        if by_ranks:
            ranks_tail(logits, num_tokens, num_experts, top_k, normalize, places, ids, weights, pair_token,
                       pair_slot, pair_out)
            return
        for t in range(warp, num_tokens, step // WARP):
            row_topk(logits, t, num_experts, top_k, normalize, ids, weights, t, lane == 0)
        cuda.syncthreads()  # every token's ids written
        sort_pairs(ids, places, num_tokens, top_k, pair_token, pair_slot, pair_out)

    return finish
