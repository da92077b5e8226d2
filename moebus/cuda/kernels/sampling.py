"""Sampling, one algorithm on every device so that a seed gives the same token on cpu and cuda:

1. ``logprob`` of the chosen token is always under the raw logits over the full vocabulary.
2. temperature <= 0: greedy, argmax with ties to the lowest id.
3. otherwise p_i = exp((l_i - max) / T); top-k keeps p >= tau_k, the k-th largest p; top-p then keeps
   p >= tau_p, the largest threshold whose kept mass is >= top_p x the top-k mass. Both thresholds are
   found by bisection on the float32 bit pattern (positive floats order like their bits), so the
   kernel needs no sort.
4. the token is the first id whose running sum of kept p exceeds u x (kept mass), u ~ U[0, 1) drawn
   by the broker from the request's seed (so batching and device do not change the draw).

A grammar constraint (structured outputs, broker/grammar.py) comes as an allowed-token bitmask:
``mask`` (M, W) uint32, bit i % 32 of word i // 32 set when id i is allowed, and ``mask_rows`` (S,)
int32, the mask row of each sampled row or -1 for an unconstrained one (which reads no mask). A masked
id counts as a -inf logit before greedy, temperature, top-k and top-p; the reported logprob stays that
of the raw logits. A row whose allowed ids all have -inf logits (after the logit rules) takes its
lowest allowed id, so a constrained row never leaves its grammar."""
from __future__ import annotations

import math

import numpy as np

from moebus.cuda.kernels.compat import (WARP, bits_as_f32, block_argmax, block_max, block_sum, cuda, device,
                                        device_with_shared, float32, int32, threads, kernel)
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import ceil_div, require

MAX_THREADS = 1024
MAX_WARPS = MAX_THREADS // 32
NEG_INF = float32(-np.inf)

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


def allowed_ids(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    """(V,) bool: the ids that one row of an allowed-token bitmask (W,) uint32 allows."""
    bits = np.unpackbits(np.ascontiguousarray(mask_row, np.uint32).view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def sample_masked_row_ref(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float,
                          allowed: np.ndarray):
    """sample_row_ref over the allowed ids only (the others as -inf); the logprob of the raw logits."""
    logits = np.asarray(logits, dtype=np.float32)
    peak = logits.max()
    lse = peak + np.log(np.sum(np.exp(logits - peak), dtype=np.float32))
    masked = np.where(allowed, logits, NEG_INF).astype(np.float32)
    if not np.isfinite(masked.max()):  # nothing allowed has a finite logit: the lowest allowed id
        token = int(np.argmax(allowed)) if allowed.any() else int(np.argmax(logits))
    else:
        token, _ = sample_row_ref(masked, temperature, top_k, top_p, u)
    return token, float(logits[token] - lse)


def sample_ref(logits, temperature, top_k, top_p, u, mask=None, mask_rows=None) -> tuple[np.ndarray, np.ndarray]:
    # logits (S, V) float32; per row temperature, top_k (0: off), top_p (1: off), u -> tokens, logprobs (S,);
    # mask (M, W) uint32 and mask_rows (S,) int32 (-1: unconstrained): see the module docstring
    rows = []
    for i in range(len(logits)):
        m = -1 if mask_rows is None else int(mask_rows[i])
        if m < 0:
            rows.append(sample_row_ref(logits[i], temperature[i], top_k[i], top_p[i], u[i]))
        else:
            allowed = allowed_ids(mask[m], logits.shape[1])
            rows.append(sample_masked_row_ref(logits[i], temperature[i], top_k[i], top_p[i], u[i], allowed))
    tokens = np.array([r[0] for r in rows], dtype=np.int32)
    logprobs = np.array([r[1] for r in rows], dtype=np.float32)
    return tokens, logprobs


def top_logprobs_ref(logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n most likely ids of one row and their log-probabilities (raw logits, full vocabulary)."""
    logits = np.asarray(logits, dtype=np.float64)
    peak = logits.max()
    lse = peak + np.log(np.sum(np.exp(logits - peak)))
    n = min(int(n), len(logits))
    if n <= 0:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    # O(V): the n-th largest value by partition, then only the candidates (ties included) sorted by
    # descending logit, ties to the lower id, as a stable full sort would order them
    kth = np.partition(logits, len(logits) - n)[len(logits) - n]
    candidates = np.nonzero(logits >= kth)[0]
    ids = candidates[np.lexsort((candidates, -logits[candidates]))][:n]
    return ids.astype(np.int32), (logits[ids] - lse).astype(np.float32)


# -- cuda -----------------------------------------------------------------------------------------
# Two launches. row_stats: blocks (c, r) reduce span c of row r to (max, its lowest id, sum of
# exp(l - max)), so the vocabulary streams through many SMs (one block a row took 66 us for greedy
# batch 1 on an H200: two passes over 151936 logits through one SM); the partials go into the row's
# first 3 x chunks scratch elements. sample_rows: one block per row combines them (a thread a span,
# then the block's fixed-order reductions: deterministic) into the argmax and the log-normaliser, and
# only rows that sample with a temperature pass over the vocabulary again. On an H200 (greedy, batch
# 1, in the replayed step) row_stats took 7.2 us and sample_rows 22.0 while each of its threads still
# read the 38 spans' partials one after another. Integer reductions (counts, ids) go through float32
# block reductions: exact while the vocabulary stays below 2^24.

STATS_SPAN = 4096  # logits per row_stats block
STATS_THREADS = 256


@kernel
def row_stats(logits, span, partial):
    grid_dependency_wait()  # pdl.py: before any global read or write
    chunk, row = cuda.blockIdx.x, cuda.blockIdx.y
    tid = cuda.threadIdx.x
    vocab = logits.shape[1]
    begin = chunk * span
    end = min(begin + span, vocab)
    best, best_id = NEG_INF, vocab
    for i in range(begin + tid, end, cuda.blockDim.x):
        if logits[row, i] > best:  # ascending ids, strict >: the lowest id wins a tie
            best, best_id = logits[row, i], i
    peak, best_id = block_argmax(best, best_id)
    total = float32(0.0)
    if peak > NEG_INF:  # a span of -inf logits adds nothing (and must not add exp(nan))
        for i in range(begin + tid, end, cuda.blockDim.x):
            total += math.exp(logits[row, i] - peak)
    total = block_sum(total)
    if tid == 0:
        partial[row, 3 * chunk] = peak
        partial[row, 3 * chunk + 1] = float32(best_id)
        partial[row, 3 * chunk + 2] = total


@device_with_shared
def _row_peak(partial, row, num_chunks, vocab):
    """(max logit, its lowest id, log of the sum of exp(l)) of a row from row_stats' partials, a
    thread a span (one pass of loads in flight, not a chain of num_chunks dependent ones)."""
    tid = cuda.threadIdx.x
    best, best_id = NEG_INF, vocab
    for c in range(tid, num_chunks, cuda.blockDim.x):  # ascending spans, strict >: the lowest id of a tie
        if partial[row, 3 * c] > best:
            best, best_id = partial[row, 3 * c], int32(partial[row, 3 * c + 1])
    peak, best_id = block_argmax(best, best_id)
    total = float32(0.0)
    for c in range(tid, num_chunks, cuda.blockDim.x):
        if partial[row, 3 * c] > NEG_INF:
            total += partial[row, 3 * c + 2] * math.exp(partial[row, 3 * c] - peak)
    return peak, best_id, peak + math.log(block_sum(total))


@device_with_shared
def _exclusive_scan(value):
    """(sum of ``value`` over lower thread ids, block total), in a fixed order."""
    items = cuda.shared.array(MAX_THREADS, float32)
    warp_prefix = cuda.shared.array(MAX_WARPS, float32)
    block_total = cuda.shared.array(1, float32)
    tid = cuda.threadIdx.x
    cuda.syncthreads()  # the previous call's readers are done
    items[tid] = value
    cuda.syncthreads()
    if tid % WARP == 0:  # each warp's first lane scans its warp...
        running = float32(0.0)
        for i in range(tid, tid + WARP):
            item = items[i]
            items[i] = running
            running += item
        warp_prefix[tid // WARP] = running
    cuda.syncthreads()
    if tid == 0:  # ...and the first thread scans the warp totals
        running = float32(0.0)
        for w in range(cuda.blockDim.x // WARP):
            total = warp_prefix[w]
            warp_prefix[w] = running
            running += total
        block_total[0] = running
    cuda.syncthreads()
    return items[tid] + warp_prefix[tid // WARP], block_total[0]


@device_with_shared
def _bisect(probs, row, by_mass, need):
    """Bits of the largest tau in [0, 1] with count(p >= tau) >= need (or mass when ``by_mass``),
    probing float32 bit patterns as sample_row_ref does."""
    lo = 0
    hi = ONE_BITS + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        tau = bits_as_f32(mid)
        kept = float32(0.0)
        for i in range(cuda.threadIdx.x, probs.shape[1], cuda.blockDim.x):
            p = probs[row, i]
            if p >= tau:
                kept += p if by_mass else float32(1.0)
        if block_sum(kept) >= need:
            lo = mid
        else:
            hi = mid
    return bits_as_f32(lo)


@device
def _is_allowed(mask, mask_row, i):
    return mask_row < 0 or (mask[mask_row, i >> 5] >> (i & 31)) & 1 != 0


@device_with_shared
def _inverse_cdf(probs, row, tau, u):
    """First id whose running sum of kept p (p >= tau, in id order) exceeds u x kept mass; the
    last kept id (p > 0) if rounding leaves none. Each thread scans one contiguous span of ids."""
    vocab = probs.shape[1]
    span = (vocab + cuda.blockDim.x - 1) // cuda.blockDim.x
    begin = min(cuda.threadIdx.x * span, vocab)
    end = min(begin + span, vocab)
    mass = float32(0.0)
    for i in range(begin, end):
        p = probs[row, i]
        if p >= tau:
            mass += p
    running, total = _exclusive_scan(mass)
    target = u * total
    first = vocab
    last_kept = -1
    for i in range(begin, end):
        p = probs[row, i]
        if p >= tau and p > 0:  # a zero p (masked, or underflowed) is never drawn
            running += p
            last_kept = i
            if running > target and first == vocab:
                first = i
    first = -block_max(float32(-first))
    last_kept = block_max(float32(last_kept))
    return int32(first) if first < vocab else int32(last_kept)


@device_with_shared
def _masked_argmax(logits, row, mask, mask_row):
    """(peak, id) over the allowed ids (lowest id of a tie); the lowest allowed id with a -inf peak
    when no allowed logit is finite; id = vocab when nothing is allowed."""
    vocab = logits.shape[1]
    best, best_id, first = NEG_INF, vocab, vocab
    for i in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):
        if _is_allowed(mask, mask_row, i):
            first = min(first, i)
            if logits[row, i] > best:
                best, best_id = logits[row, i], i
    peak, best_id = block_argmax(best, best_id)
    first = -block_max(float32(-first))
    return peak, (int32(best_id) if best_id < vocab else int32(first))


@kernel
def sample_rows(logits, temperature, top_k, top_p, u, mask, mask_rows, span, probs, tokens, logprobs):
    # probs: row_stats' partials in its first elements, then the row's probabilities
    grid_dependency_wait()  # pdl.py: before any global read or write
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    vocab = logits.shape[1]
    peak, best_id, log_norm = _row_peak(probs, row, (vocab + span - 1) // span, vocab)
    cuda.syncthreads()  # every thread has read the partials before any overwrites them
    token = int32(best_id)
    mask_row = mask_rows[row] if mask_rows.shape[0] > 0 else -1  # the same for the whole block
    if mask_row >= 0:
        peak, token = _masked_argmax(logits, row, mask, mask_row)
        token = token if token < vocab else int32(best_id)  # an empty mask (never sent): unconstrained
    temp = temperature[row]
    if temp > 0 and peak > NEG_INF:
        for i in range(tid, vocab, cuda.blockDim.x):
            allowed = _is_allowed(mask, mask_row, i)
            probs[row, i] = math.exp((logits[row, i] - peak) / temp) if allowed else float32(0.0)
        cuda.syncthreads()  # probs rows are read across threads from here on
        tau = float32(0.0)
        if 0 < top_k[row] < vocab:
            tau = _bisect(probs, row, False, float32(top_k[row]))
        if top_p[row] < 1.0:
            mass = float32(0.0)
            for i in range(tid, vocab, cuda.blockDim.x):
                if probs[row, i] >= tau:
                    mass += probs[row, i]
            target = top_p[row] * block_sum(mass)
            tau = max(tau, _bisect(probs, row, True, target))
        token = _inverse_cdf(probs, row, tau, u[row])
    if tid == 0:
        tokens[row] = token
        logprobs[row] = logits[row, token] - log_norm


def sample_cuda(logits, temperature, top_k, top_p, u, tokens, logprobs, scratch, stream=0, mask=None,
                mask_rows=None):
    """sample_ref on device arrays: logits (S, V) float32; temperature, top_p, u (S,) float32; top_k
    (S,) int32 -> tokens (S,) int32, logprobs (S,) float32. ``scratch``: (S, V) float32. ``mask``
    (M, ceil(V / 32)) uint32 and ``mask_rows`` (S,) int32 together, or neither (no row constrained:
    then zero-length arrays stand in for them and no thread reads a mask)."""
    num_rows, vocab = logits.shape
    require("logits", logits, np.float32, ndim=2)
    for name, array, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                               ("top_p", top_p, np.float32), ("u", u, np.float32),
                               ("tokens", tokens, np.int32), ("logprobs", logprobs, np.float32)):
        require(name, array, dtype, shape=(num_rows,))
    require("scratch", scratch, np.float32, shape=(num_rows, vocab))
    if (mask is None) != (mask_rows is None):
        raise ValueError("mask and mask_rows come together")
    if mask is not None:
        require("mask", mask, np.uint32, ndim=2)
        require("mask_rows", mask_rows, np.int32, shape=(num_rows,))
        if mask.shape[1] != mask_words(vocab):
            raise ValueError(f"mask rows of {mask.shape[1]} words; a vocabulary of {vocab} needs {mask_words(vocab)}")
    if not 3 <= vocab < 1 << 24:
        raise ValueError(f"vocabulary of {vocab}: at least 3 (a scratch row holds the partials), ids exact in float32")
    if num_rows:
        if mask is None:
            mask, mask_rows = _no_mask(vocab, on_host=isinstance(logits, np.ndarray))
        span = STATS_SPAN if 3 * ceil_div(vocab, STATS_SPAN) <= vocab else vocab  # the partials fit the scratch row
        row_stats[(ceil_div(vocab, span), num_rows), threads(STATS_THREADS), stream](logits, span, scratch)
        block = threads(MAX_THREADS)
        sample_rows[num_rows, block, stream](logits, temperature, top_k, top_p, u, mask, mask_rows, span, scratch,
                                             tokens, logprobs)
    return tokens, logprobs


def mask_words(vocab: int) -> int:
    """uint32 words in one row of an allowed-token bitmask."""
    return (vocab + 31) // 32


def _no_mask(vocab: int, on_host: bool = False):
    """Zero-length stand-ins (the kernel takes arrays; these are never read). Zero bytes: no
    allocation and no copy, so this is safe inside a graph capture too (as the step pool's own).
    ``on_host``: the caller passed host arrays (the PTX check compiles without a driver)."""
    if on_host:
        return np.zeros((0, mask_words(vocab)), np.uint32), np.zeros(0, np.int32)
    return cuda.device_array((0, mask_words(vocab)), np.uint32), cuda.device_array(0, np.int32)
