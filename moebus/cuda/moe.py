"""Mixture-of-experts ops. The router picks top-k experts per token; the experts run from an
*arena*: one buffer indexed by slot, slot i holding one expert as a blob gate (I x D) | up (I x D) |
down (D x I) in the stored weight dtype. Work is listed as *pairs* p = t * A + k (token t, its k-th
choice), each with the arena slot of its expert, so kernels need one array plus a slot table.

Shapes: T tokens, E experts, D hidden, I expert intermediate, A active experts per token, P = T * A."""
from __future__ import annotations

import numpy as np

from moebus.cuda.dtypes import to_f32
from moebus.cuda.elementwise import silu_ref


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


def expert_ffn_ref(x, pair_token, pair_slot, pair_out, arena, hidden: int, inter: int, out) -> np.ndarray:
    # x (T, D) float32; pair_token, pair_slot, pair_out (J,) int32; out (P, D) float32, J <= P.
    # out[pair_out[j]] = down(silu(gate x) * up x) with x = x[pair_token[j]] and the expert in arena
    # slot pair_slot[j]; other rows of out are left alone (hits and misses run as two calls).
    x = np.asarray(x, dtype=np.float32)
    pair_token, pair_slot, pair_out = (np.asarray(a) for a in (pair_token, pair_slot, pair_out))
    for slot in np.unique(pair_slot):
        pairs = np.nonzero(pair_slot == slot)[0]
        gate, up, down = (to_f32(w) for w in expert_blob_views(arena, int(slot), hidden, inter))
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
