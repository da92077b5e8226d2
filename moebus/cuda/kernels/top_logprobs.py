"""The n most likely ids of each row and their log-probabilities under the raw logits, on the device
(OpenAI ``logprobs`` / ``top_logprobs``): the host gets (S, n) ids and values instead of (S, V)
logits and a full-vocabulary sort per row. Order as ``sampling.top_logprobs_ref``: descending
logit, ties to the lower id.

One block per row: a logsumexp pass, then n passes of a block argmax, pass k taking the best element
strictly after pass k-1's pick in (descending logit, ascending id) order, so nothing is marked and
the row is only read."""
from __future__ import annotations

import math

import numpy as np

from moebus.cuda.kernels.compat import block_argmax, block_max, block_sum, cuda, float32, int64, threads, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import require
from moebus.cuda.kernels.sampling import top_logprobs_ref

THREADS = 1024
NEG_INF = float32(-np.inf)
POS_INF = float32(np.inf)


def top_logprobs_rows_ref(logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    # logits (S, V) float32 -> ids (S, n) int32, logprobs (S, n) float32
    rows = [top_logprobs_ref(row, n) for row in np.asarray(logits)]
    return (np.stack([r[0] for r in rows]).astype(np.int32).reshape(len(rows), n),
            np.stack([r[1] for r in rows]).astype(np.float32).reshape(len(rows), n))


@kernel
def top_logprobs_rows(logits, n, ids, logprobs):
    grid_dependency_wait()  # pdl.py: before any global read or write
    row = cuda.blockIdx.x
    vocab = logits.shape[1]
    peak = NEG_INF
    for i in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):
        peak = max(peak, logits[row, i])
    peak = block_max(peak)
    total = float32(0.0)
    for i in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):
        total += math.exp(logits[row, i] - peak)
    lse = peak + math.log(block_sum(total))
    last_value, last_id = POS_INF, int64(-1)
    for k in range(n):
        best, best_id = NEG_INF, int64(vocab)
        for i in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):
            value = logits[row, i]
            after_last = value < last_value or (value == last_value and i > last_id)
            if after_last and (value > best or (value == best and i < best_id)):
                best, best_id = value, int64(i)
        best, best_id = block_argmax(best, best_id)
        if cuda.threadIdx.x == 0:
            ids[row, k] = best_id
            logprobs[row, k] = best - lse
        last_value, last_id = best, best_id


def top_logprobs_cuda(logits, n: int, ids, logprobs, stream=0):
    """top_logprobs_rows_ref into ids (S, n) int32 and logprobs (S, n) float32 device arrays."""
    num_rows, vocab = logits.shape
    require("logits", logits, np.float32, ndim=2)
    require("ids", ids, np.int32, shape=(num_rows, n))
    require("logprobs", logprobs, np.float32, shape=(num_rows, n))
    if not 0 < n <= vocab:
        raise ValueError(f"top_logprobs {n} outside 1..{vocab}")
    if num_rows:
        top_logprobs_rows[num_rows, threads(THREADS), stream](logits, int(n), ids, logprobs)
    return ids, logprobs
