"""Sampling, one algorithm on every device so that a seed gives the same token on cpu and cuda:

1. ``logprob`` of the chosen token is always under the raw logits over the full vocabulary.
2. temperature <= 0: greedy, argmax with ties to the lowest id.
3. otherwise p_i = exp((l_i - max) / T); top-k keeps p >= tau_k, the k-th largest p; top-p then keeps
   p >= tau_p, the largest threshold whose kept mass is >= top_p x the top-k mass. Both thresholds are
   found by bisection on the float32 bit pattern (positive floats order like their bits), so the
   kernel needs no sort.
4. the token is the first id whose running sum of kept p exceeds u x (kept mass), u ~ U[0, 1) drawn
   by the broker from the request's seed (so batching and device do not change the draw)."""
from __future__ import annotations

import numpy as np

ONE_BITS = int(np.float32(1.0).view(np.int32))


def _bisect_threshold(p: np.ndarray, keep_if) -> np.float32:
    """Largest float32 tau (by bits, in [0, 1]) with keep_if(p >= tau) true; keep_if is monotone."""
    lo, hi = 0, ONE_BITS + 1  # keep_if holds at lo (tau = 0), fails above 1.0 (nothing kept)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if keep_if(p >= np.int32(mid).view(np.float32)):
            lo = mid
        else:
            hi = mid
    return np.int32(lo).view(np.float32)


def sample_row_ref(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float):
    """(token, logprob) for one row of float32 logits."""
    logits = np.asarray(logits, dtype=np.float32)
    peak = logits.max()
    lse = peak + np.log(np.sum(np.exp(logits - peak), dtype=np.float32))
    if temperature <= 0:
        token = int(np.argmax(logits))
        return token, float(logits[token] - lse)
    p = np.exp((logits - peak) / np.float32(temperature)).astype(np.float32)
    tau = np.float32(0.0)
    if 0 < top_k < len(p):
        tau = _bisect_threshold(p, lambda kept: np.count_nonzero(kept) >= top_k)
    if top_p < 1.0:
        mass = np.sum(p[p >= tau], dtype=np.float32)
        target = np.float32(top_p) * mass
        tau = max(tau, _bisect_threshold(p, lambda kept: np.sum(p[kept], dtype=np.float32) >= target))
    kept = np.where(p >= tau, p, np.float32(0.0))
    running = np.cumsum(kept, dtype=np.float32)
    token = int(np.searchsorted(running, np.float32(u) * running[-1], side="right"))
    token = min(token, int(np.nonzero(kept)[0][-1]))
    return token, float(logits[token] - lse)


def sample_ref(logits, temperature, top_k, top_p, u) -> tuple[np.ndarray, np.ndarray]:
    # logits (S, V) float32; per row temperature, top_k (0: off), top_p (1: off), u -> tokens, logprobs (S,)
    rows = [sample_row_ref(logits[i], temperature[i], top_k[i], top_p[i], u[i]) for i in range(len(logits))]
    tokens = np.array([r[0] for r in rows], dtype=np.int32)
    logprobs = np.array([r[1] for r in rows], dtype=np.float32)
    return tokens, logprobs


def top_logprobs_ref(logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n most likely ids of one row and their log-probabilities (raw logits, full vocabulary)."""
    logits = np.asarray(logits, dtype=np.float64)
    lse = logits.max() + np.log(np.sum(np.exp(logits - logits.max())))
    ids = np.argsort(-logits, kind="stable")[:n]
    return ids.astype(np.int32), (logits[ids] - lse).astype(np.float32)
