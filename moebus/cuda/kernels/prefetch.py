"""Prefetch of the next layer's experts (issue 15, item 2): kernels for a second branch of the decode
step. While layer L's experts and layer L+1's attention run, layer L+1's router ranks layer L's MLP
input (linear + topk_softmax, the existing kernels; or ``plan_from_logits``, top-k and plan in one
launch), and

- ``plan_prefetch`` (one block) picks the predicted experts of layer L+1 that the placement table
  says are not resident: most tokens first, then the best rank a token gave it, then the lowest id,
  at most K (the bank's slots); writes their host-store rows (keys), -1 where fewer;
- ``copy_prefetch`` copies those rows of the mapped host store into the bank's K arena slots (a
  kernel, since which rows is known only on the device);
- ``remap_prefetched`` (after the branch joins, before layer L+1's experts) points each pair whose
  placement is the host store at the bank slot that now holds its expert (the GEMV path);
- ``remap_placement`` does the same for layer L+1's row of the placement table, into a copy (the
  tiles on tensor cores, moe_prefill.grouped_moe_placed, plan from the row; the table itself
  stays as the cache keeps it, since the banks are overwritten by every step).

An expert read from a bank slot holds the same bytes as its host-store row, so the experts compute
the same bits either way (moe_ffn.py: a pair's arithmetic does not depend on its slot).

Shapes: T tokens, M predicted experts a token, E experts, K slots a bank, L MoE layer rows."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.compat import blocks, cuda, device, int32, threads, kernel, uint16, uint32, uint64
from moebus.cuda.kernels.pdl import grid_dependency_wait
from numba import uint8  # noqa: E402 - after compat, which readies numpy for numba
from moebus.cuda.kernels.launch import ceil_div, require
from moebus.cuda.kernels.routing import MAX_EXPERTS

PLAN_THREADS = 256
COPY_THREADS = 256
COPY_BLOCKS_PER_SLOT = 16  # 16 x 256 threads x COPY_UNROLL words in flight a slot: PCIe's latency covered
COPY_UNROLL = 4  # (both read at each launch: tools/device/miss12_check.py's ``bNuM`` variants set them)
REMAP_THREADS = 128


def plan_prefetch_ref(ids, table, layer_row: int, num_slots: int) -> np.ndarray:
    # ids (T, M) int32, best first; table (L, E) -> keys (K,) int32: host-store rows of the
    # chosen non-resident experts, -1 after the last
    num_experts = table.shape[1]
    votes = np.zeros(num_experts, np.int64)
    best = np.full(num_experts, ids.shape[1], np.int64)
    for row in np.asarray(ids):
        for rank, e in enumerate(row):
            votes[e] += 1
            best[e] = min(best[e], rank)
    entries = np.asarray(table)[layer_row]
    chosen = sorted((e for e in range(num_experts) if votes[e] and entries[e] < 0),
                    key=lambda e: (-votes[e], best[e], e))[:num_slots]
    keys = np.full(num_slots, -1, np.int32)
    keys[:len(chosen)] = [-1 - entries[e] for e in chosen]
    return keys


@kernel
def plan_rows(ids, table, layer_row, keys):
    grid_dependency_wait()  # pdl.py: before any global read or write
    num_tokens, per_token = ids.shape
    num_experts = table.shape[1]
    tid, step = cuda.threadIdx.x, cuda.blockDim.x
    votes = cuda.shared.array(MAX_EXPERTS, int32)
    best = cuda.shared.array(MAX_EXPERTS, int32)
    count = cuda.shared.array(1, int32)
    _clear_votes(votes, best, count, num_experts, per_token)
    for p in range(tid, num_tokens * per_token, step):
        e = ids[p // per_token, p % per_token]
        cuda.atomic.add(votes, e, 1)
        cuda.atomic.min(best, e, p % per_token)
    cuda.syncthreads()
    _choose(votes, best, table, layer_row, keys, count)


@device
def _clear_votes(votes, best, count, num_experts, per_token):
    """The block's shared ``votes`` zero, ``best`` ``per_token`` (no rank yet), ``count`` [0] zero."""
    tid, step = cuda.threadIdx.x, cuda.blockDim.x
    for e in range(tid, num_experts, step):
        votes[e] = 0
        best[e] = per_token
    if tid == 0:
        count[0] = 0
    cuda.syncthreads()


@device
def _choose(votes, best, table, layer_row, keys, count):
    """The block's shared ``votes`` and ``best`` (E,) counted, ``count`` [0] zero: the candidates
    into ``keys``, most votes first, -1 after the last."""
    num_experts, num_slots = table.shape[1], keys.shape[0]
    tid, step = cuda.threadIdx.x, cuda.blockDim.x
    for e in range(tid, num_experts, step):
        if votes[e] > 0 and table[layer_row, e] < 0:
            cuda.atomic.add(count, 0, 1)
            rank = 0  # candidates ahead of e: more votes, then a better rank, then a lower id
            for other in range(num_experts):
                if votes[other] > 0 and table[layer_row, other] < 0:
                    if votes[other] > votes[e] or (votes[other] == votes[e] and (
                            best[other] < best[e] or (best[other] == best[e] and other < e))):
                        rank += 1
            if rank < num_slots:
                keys[rank] = -1 - table[layer_row, e]
    cuda.syncthreads()
    for k in range(tid, num_slots, step):
        if k >= count[0]:
            keys[k] = -1


@kernel
def plan_rows_from_logits(logits, per_token, table, layer_row, keys):
    """plan_rows over each token's top ``per_token`` of the router's ``logits`` (T, E), ranked here:
    one launch on the side branch instead of top-k + plan (each waits for SMs beside the experts)."""
    grid_dependency_wait()  # pdl.py: before any global read or write
    num_tokens, num_experts = logits.shape
    tid, step = cuda.threadIdx.x, cuda.blockDim.x
    votes = cuda.shared.array(MAX_EXPERTS, int32)
    best = cuda.shared.array(MAX_EXPERTS, int32)
    count = cuda.shared.array(1, int32)
    _clear_votes(votes, best, count, num_experts, per_token)
    for p in range(tid, num_tokens * num_experts, step):
        t, e = p // num_experts, p % num_experts
        rank = 0  # experts ahead of e for token t: a larger logit, or an equal one and a lower id
        for other in range(num_experts):
            if logits[t, other] > logits[t, e] or (logits[t, other] == logits[t, e] and other < e):
                rank += 1
        if rank < per_token:
            cuda.atomic.add(votes, e, 1)
            cuda.atomic.min(best, e, rank)
    cuda.syncthreads()
    _choose(votes, best, table, layer_row, keys, count)


def plan_from_logits_ref(logits, per_token: int, table, layer_row: int, num_slots: int) -> np.ndarray:
    # logits (T, E) float32 -> plan_prefetch_ref over each token's top per_token (ties: the lower id)
    ids = np.argsort(-np.asarray(logits), axis=1, kind="stable")[:, :per_token]
    return plan_prefetch_ref(ids, table, layer_row, num_slots)


def plan_from_logits_cuda(logits, per_token: int, table, layer_row: int, keys, stream=0):
    """plan_from_logits_ref into ``keys`` (K,) int32 on the device."""
    require("logits", logits, np.float32, ndim=2)
    require("table", table, np.int32, ndim=2)
    require("keys", keys, np.int32, ndim=1)
    if table.shape[1] > MAX_EXPERTS or logits.shape[1] != table.shape[1] or not 0 <= layer_row < table.shape[0]:
        raise ValueError(f"layer row {layer_row} of a {tuple(table.shape)} table, logits {tuple(logits.shape)} "
                         f"(at most {MAX_EXPERTS} experts)")
    plan_rows_from_logits[1, threads(PLAN_THREADS), stream](logits, int(per_token), table, int(layer_row), keys)
    return keys


def plan_prefetch_cuda(ids, table, layer_row: int, keys, stream=0):
    """plan_prefetch_ref into ``keys`` (K,) int32 on the device."""
    require("ids", ids, np.int32, ndim=2)
    require("table", table, np.int32, ndim=2)
    require("keys", keys, np.int32, ndim=1)
    if table.shape[1] > MAX_EXPERTS or not 0 <= layer_row < table.shape[0]:
        raise ValueError(f"layer row {layer_row} of a {tuple(table.shape)} table (at most {MAX_EXPERTS} experts)")
    plan_rows[1, threads(PLAN_THREADS), stream](ids, table, int(layer_row), keys)
    return keys


def copy_prefetch_ref(keys, store, arena, first_slot: int) -> None:
    for k, key in enumerate(np.asarray(keys)):
        if key >= 0:
            arena[first_slot + k] = store[key]


@functools.cache
def _copy_kernel(word, unroll: int = COPY_UNROLL):
    @kernel
    def copy_rows(keys, store, arena, first_slot):
        grid_dependency_wait()  # pdl.py: before any global read or write
        key = keys[cuda.blockIdx.y]
        if key < 0:
            return  # the whole block: nothing predicted for this slot
        slot = first_slot + cuda.blockIdx.y
        num_words = store.shape[1]
        stride = cuda.gridDim.x * cuda.blockDim.x
        start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        buf = cuda.local.array(unroll, word)
        for base in range(start, num_words, stride * unroll):
            for u in range(unroll):  # every load of the round out over PCIe before the first store
                w = base + u * stride
                if w < num_words:
                    buf[u] = store[key, w]
            for u in range(unroll):
                w = base + u * stride
                if w < num_words:
                    arena[slot, w] = buf[u]

    return copy_rows


_NUMBA_WORDS = {np.dtype(np.uint64).str: uint64, np.dtype(np.uint32).str: uint32, np.dtype(np.uint16).str: uint16,
                np.dtype(np.uint8).str: uint8}


def _words(array):
    """A (rows, words) view of 2-D rows in the widest unsigned words their length divides into."""
    row_bytes = array.shape[1] * array.dtype.itemsize
    for dtype in (np.uint64, np.uint32, np.uint16, np.uint8):
        if row_bytes % np.dtype(dtype).itemsize == 0:
            return array.view(dtype)
    raise AssertionError("every row divides into bytes")


def copy_prefetch_cuda(keys, store, arena, first_slot: int, stream=0):
    """copy_prefetch_ref on the device: host-store rows ``keys`` (K,) int32 (-1: none) into arena
    slots first_slot .. first_slot + K - 1. ``store``: the mapped host store as the kernels read it."""
    require("keys", keys, np.int32, ndim=1)
    require("store", store, ndim=2)
    require("arena", arena, ndim=2)
    if store.dtype != arena.dtype or store.shape[1] != arena.shape[1]:
        raise ValueError(f"store rows {store.shape[1]} x {store.dtype} vs arena slots {arena.shape[1]} x {arena.dtype}")
    if not 0 <= first_slot <= arena.shape[0] - keys.shape[0]:
        raise ValueError(f"slots {first_slot}..{first_slot + keys.shape[0] - 1} outside the arena's {arena.shape[0]}")
    if keys.shape[0] == 0:
        return arena
    grid = (blocks(COPY_BLOCKS_PER_SLOT), keys.shape[0])
    store_words, arena_words = _words(store), _words(arena)
    kernel = _copy_kernel(_NUMBA_WORDS[np.dtype(store_words.dtype).str], COPY_UNROLL)
    kernel[grid, threads(COPY_THREADS), stream](keys, store_words, arena_words, int(first_slot))
    return arena


def remap_prefetched_ref(pair_slot, keys, first_slot: int) -> np.ndarray:
    out = np.array(pair_slot, np.int32)
    for j, entry in enumerate(out):
        if entry < 0:
            hits = np.nonzero(np.asarray(keys) == -1 - entry)[0]
            if len(hits):
                out[j] = first_slot + hits[0]
    return out


@kernel
def remap_pairs(pair_slot, keys, first_slot):
    grid_dependency_wait()  # pdl.py: before any global read or write
    for j in range(cuda.grid(1), pair_slot.shape[0], cuda.gridsize(1)):
        entry = pair_slot[j]
        if entry < 0:
            for k in range(keys.shape[0]):
                if keys[k] == -1 - entry:
                    pair_slot[j] = first_slot + k
                    break


def remap_prefetched_cuda(pair_slot, keys, first_slot: int, stream=0):
    """remap_prefetched_ref in place on the device (pair_slot (P,) int32)."""
    require("pair_slot", pair_slot, np.int32, ndim=1)
    require("keys", keys, np.int32, ndim=1)
    if pair_slot.shape[0]:
        remap_pairs[blocks(ceil_div(pair_slot.shape[0], REMAP_THREADS)), threads(REMAP_THREADS), stream](
            pair_slot, keys, int(first_slot))
    return pair_slot


def remap_placement_ref(table, layer_row: int, keys, first_slot: int) -> np.ndarray:
    # table (L, E) int32, keys (K,) -> (E,) int32: the row, host-store entries that a bank slot holds
    # pointing at that slot
    return remap_prefetched_ref(np.asarray(table)[layer_row], keys, first_slot)


@kernel
def remap_row(table, layer_row, keys, first_slot, out):
    grid_dependency_wait()  # pdl.py: before any global read or write
    for e in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        entry = table[layer_row, e]
        out[e] = entry
        if entry < 0:
            for k in range(keys.shape[0]):
                if keys[k] == -1 - entry:
                    out[e] = first_slot + k
                    break


def remap_placement_cuda(table, layer_row: int, keys, first_slot: int, out, stream=0):
    """remap_placement_ref into ``out`` (E,) int32 on the device."""
    require("table", table, np.int32, ndim=2)
    require("keys", keys, np.int32, ndim=1)
    require("out", out, np.int32, ndim=1)
    if out.shape[0] != table.shape[1] or not 0 <= layer_row < table.shape[0]:
        raise ValueError(f"row {layer_row} of a {tuple(table.shape)} table into {out.shape[0]} entries")
    remap_row[blocks(ceil_div(out.shape[0], REMAP_THREADS)), threads(REMAP_THREADS), stream](
        table, int(layer_row), keys, int(first_slot), out)
    return out
