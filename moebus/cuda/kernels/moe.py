"""Mixture-of-experts ops. The router picks top-k experts per token; the experts run from an
*arena*: one buffer indexed by slot, slot i holding one expert as a blob gate (I x D) | up (I x D) |
down (D x I) in the stored weight dtype. Work is listed as *pairs* p = t * A + k (token t, its k-th
choice), each with the arena slot of its expert, so kernels need one array plus a slot table.

Shapes: T tokens, E experts, D hidden, I expert intermediate, A active experts per token, P = T * A."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import WARP, blocks, cuda, device, float32, threads, warp_argmax, warp_max, warp_sum, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.elementwise import silu_ref
from moebus.cuda.kernels.launch import ceil_div, require, warp_per_row

THREADS = 256
ROUTER_WARPS = 4  # tokens in flight per block
NEG_INF = float32(-np.inf)
TAKEN = float32(-1.0)  # below every probability: an expert already chosen, or padding


def topk_softmax_ref(logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    # logits (T, E) float32 -> ids (T, A) int32 (by descending probability, ties to the lower id),
    # weights (T, A) float32 (softmax probabilities, renormalised over the top-k when normalize)
    logits = np.asarray(logits, dtype=np.float32)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    weights = np.take_along_axis(probs, ids, axis=-1).astype(np.float32)
    if normalize:
        weights /= weights.sum(axis=-1, keepdims=True)
    return ids, weights


def expert_blob_views(arena: np.ndarray, slot: int, hidden: int, inter: int):
    """(gate, up, down) views of one arena slot; arena (num_slots, slot_elems) stored dtype."""
    blob = arena[slot]
    n = inter * hidden
    return (blob[:n].reshape(inter, hidden), blob[n : 2 * n].reshape(inter, hidden),
            blob[2 * n : 3 * n].reshape(hidden, inter))


def expert_ffn_ref(x, pair_token, pair_slot, pair_out, arena, hidden: int, inter: int, out, store=None) -> np.ndarray:
    # x (T, D) float32; pair_token, pair_slot, pair_out (J,) int32; out (P, D) float32, J <= P.
    # out[pair_out[j]] = down(silu(gate x) * up x) with x = x[pair_token[j]] and the expert in arena
    # slot pair_slot[j], or for a negative entry in row -1 - pair_slot[j] of the host store;
    # other rows of out are left alone (hits and misses run as two calls).
    x = np.asarray(x, dtype=np.float32)
    pair_token, pair_slot, pair_out = (np.asarray(a) for a in (pair_token, pair_slot, pair_out))
    for slot in np.unique(pair_slot):
        pairs = np.nonzero(pair_slot == slot)[0]
        source, row = (arena, int(slot)) if slot >= 0 else (store, -1 - int(slot))
        gate, up, down = (to_f32(w) for w in expert_blob_views(source, row, hidden, inter))
        xs = x[pair_token[pairs]]
        out[pair_out[pairs]] = (silu_ref(xs @ gate.T) * (xs @ up.T)) @ down.T
    return out


def combine_ref(y_pair: np.ndarray, weights: np.ndarray) -> np.ndarray:
    # y_pair (T * A, D), weights (T, A) -> (T, D): sum over k in order 0..A-1
    num_tokens, top_k = weights.shape
    y = y_pair.reshape(num_tokens, top_k, -1)
    out = np.zeros((num_tokens, y.shape[-1]), dtype=np.float32)
    for k in range(top_k):
        out += weights[:, k : k + 1] * y[:, k]
    return out


# -- cuda: router and combine ---------------------------------------------------------------------

@functools.cache
def topk_row(per_lane: int):
    """Device function: the top-k of one row of logits by one warp, ids by descending probability
    (ties to the lower id), weights the softmax probabilities (renormalised when ``normalize``);
    lane l holds experts l, l + 32, ... (per_lane of them) in registers. ``store``: this lane
    writes ids[out_row] and weights[out_row] (lane 0 of a warp whose row is real)."""

    @device
    def topk_softmax_row(logits, row, num_experts, top_k, normalize, ids, weights, out_row, store):
        lane = cuda.threadIdx.x % WARP
        probs = cuda.local.array(per_lane, float32)
        peak = NEG_INF
        for i in range(per_lane):
            e = lane + i * WARP
            probs[i] = logits[row, e] if e < num_experts else NEG_INF
            peak = max(peak, probs[i])
        peak = warp_max(peak)
        total = float32(0.0)
        for i in range(per_lane):
            probs[i] = math.exp(probs[i] - peak)  # exp(-inf) = 0 for the padding
            total += probs[i]
        total = warp_sum(total)
        for i in range(per_lane):
            # rank the normalised probabilities, as the reference does; padding can never win
            probs[i] = probs[i] / total if lane + i * WARP < num_experts else TAKEN
        chosen = float32(0.0)
        for k in range(top_k):
            best, best_e = TAKEN, num_experts
            for i in range(per_lane):  # ascending e, strict >: a lane keeps its lowest tie
                if probs[i] > best:
                    best, best_e = probs[i], lane + i * WARP
            best, best_e = warp_argmax(best, best_e)
            for i in range(per_lane):
                if lane + i * WARP == best_e:
                    probs[i] = TAKEN
            chosen += best
            if store:
                ids[out_row, k] = best_e
                weights[out_row, k] = best
        if normalize and store:
            for k in range(top_k):
                weights[out_row, k] = weights[out_row, k] / chosen

    return topk_softmax_row


@functools.cache
def _topk_kernel(per_lane: int):
    """One warp per token (topk_row)."""
    row_topk = topk_row(per_lane)

    @kernel
    def topk_rows(logits, top_k, normalize, ids, weights):
        grid_dependency_wait()  # pdl.py: before any global read or write
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        num_tokens, num_experts = logits.shape
        for start in range(0, num_tokens, stride):
            t = min(start + first, num_tokens - 1)
            is_real = lane == 0 and start + first < num_tokens
            row_topk(logits, t, num_experts, top_k, normalize, ids, weights, t, is_real)

    return topk_rows


def topk_softmax_cuda(logits, top_k: int, normalize: bool, ids, weights, stream=0):
    """topk_softmax_ref into ids (T, A) int32 and weights (T, A) float32 device arrays."""
    num_tokens, num_experts = logits.shape
    require("logits", logits, np.float32, ndim=2)
    require("ids", ids, np.int32, shape=(num_tokens, top_k))
    require("weights", weights, np.float32, shape=(num_tokens, top_k))
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} outside 1..{num_experts}")
    if num_tokens == 0:
        return ids, weights
    grid, block = warp_per_row(num_tokens, ROUTER_WARPS)
    kernel = _topk_kernel(ceil_div(num_experts, WARP))
    kernel[grid, block, stream](logits, int(top_k), bool(normalize), ids, weights)
    return ids, weights


@kernel
def combine_flat(y_pair, weights, out):
    grid_dependency_wait()  # pdl.py: before any global read or write
    num_tokens, top_k = weights.shape
    dim = out.shape[1]
    for n in range(cuda.grid(1), num_tokens * dim, cuda.gridsize(1)):
        t = n // dim
        d = n % dim
        total = float32(0.0)
        for k in range(top_k):  # in order 0..A-1, as the reference
            total += weights[t, k] * y_pair[t * top_k + k, d]
        out[t, d] = total


def combine_cuda(y_pair, weights, out, stream=0):
    """out (T, D) = combine_ref(y_pair (T * A, D), weights (T, A)), float32."""
    num_tokens, top_k = weights.shape
    require("weights", weights, np.float32, ndim=2)
    require("y_pair", y_pair, np.float32, shape=(num_tokens * top_k, None))
    require("out", out, np.float32, shape=(num_tokens, y_pair.shape[1]))
    if out.size:
        grid = blocks(ceil_div(out.size, THREADS))
        combine_flat[grid, threads(THREADS), stream](y_pair, weights, out)
    return out
