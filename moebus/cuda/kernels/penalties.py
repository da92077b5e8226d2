"""Logit rules applied before sampling, as vLLM defines them, in vLLM's order:

1. ``logit_bias``: l_t += bias_t for the request's biased ids.
2. ``repetition_penalty`` r over every id seen in the prompt or the output: l_t / r if l_t > 0, else l_t * r.
3. ``frequency_penalty`` f and ``presence_penalty`` p over the output: l_t -= f * count_t + p * (count_t > 0).
4. ``min_p`` m (with temperature T > 0): drop ids whose probability is below m x the top one's, as
   -inf logits: p_t / p_max < m  <=>  l_t - l_max < T ln m, so no softmax is needed here.

Top-k / top-p / the draw then run on the result (cuda/kernels/sampling.py). The log-probability that a
request reports stays that of the raw logits (``token_logprobs``), as vLLM reports it.

Per row, the ids that a rule touches come as one compact list (CSR: ``offsets`` (S+1,) into
``ids``/``counts``/``bias``), never as a vocabulary-wide mask: ``counts`` is the id's number of
occurrences in the output, 0 for an id seen only in the prompt, -1 for an id that is only biased
(outside the history, so no penalty applies). Ids are unique within a row, so threads never race.
``params`` (S, 4) float32 holds per row: frequency, presence, repetition, min_p (0, 0, 1, 0: off).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moebus.cuda.kernels.compat import block_max, block_sum, cuda, float32, int32, threads, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import require

MAX_THREADS = 1024
NUM_PARAMS = 4  # frequency, presence, repetition, min_p
NEG_INF = float32(-np.inf)


@dataclass
class LogitRules:
    """One step's rules for the last stage, rows in step order (see the module docstring)."""

    params: np.ndarray  # (S, 4) float32
    offsets: np.ndarray  # (S + 1,) int32
    ids: np.ndarray  # (H,) int32
    counts: np.ndarray  # (H,) int32
    bias: np.ndarray  # (H,) float32

    @classmethod
    def from_lengths(cls, params, lengths, ids, counts, bias) -> "LogitRules":
        """From per-row entry counts, as the STEP message carries them."""
        offsets = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        return cls(np.ascontiguousarray(params, np.float32), offsets, np.ascontiguousarray(ids, np.int32),
                   np.ascontiguousarray(counts, np.int32), np.ascontiguousarray(bias, np.float32))

    def take(self, rows: np.ndarray) -> "LogitRules":
        """The rules of some rows only (a step split into pieces)."""
        spans = [np.arange(self.offsets[r], self.offsets[r + 1]) for r in rows]
        picked = np.concatenate(spans).astype(np.int64) if spans else np.zeros(0, np.int64)
        return LogitRules.from_lengths(self.params[rows], [len(s) for s in spans], self.ids[picked],
                                       self.counts[picked], self.bias[picked])


def apply_rules_row_ref(logits: np.ndarray, temperature: float, params, ids, counts, bias) -> np.ndarray:
    """One row of float32 logits after the rules (a new array)."""
    out = np.array(logits, dtype=np.float32)
    frequency, presence, repetition, min_p = (np.float32(v) for v in params)
    ids = np.asarray(ids, np.int64)
    counts = np.asarray(counts)
    seen = counts >= 0
    out[ids] += np.asarray(bias, np.float32)
    l = out[ids[seen]]
    l = np.where(l > 0, l / repetition, l * repetition)
    c = counts[seen].astype(np.float32)
    out[ids[seen]] = l - frequency * c - presence * (c > 0).astype(np.float32)
    if temperature > 0 and min_p > 0:
        floor = out.max() + np.float32(temperature) * np.float32(math.log(min_p))
        out[out < floor] = NEG_INF
    return out


def apply_rules_ref(logits, temperature, rules: LogitRules) -> np.ndarray:
    # logits (S, V) float32, temperature (S,) -> (S, V) float32
    check_rules(rules, *logits.shape)
    rows = []
    for r in range(len(logits)):
        span = slice(rules.offsets[r], rules.offsets[r + 1])
        rows.append(apply_rules_row_ref(logits[r], temperature[r], rules.params[r], rules.ids[span],
                                        rules.counts[span], rules.bias[span]))
    return np.stack(rows) if rows else np.zeros_like(logits, dtype=np.float32)


def token_logprobs_ref(logits, tokens) -> np.ndarray:
    """log softmax of each row's raw logits at its token: (S, V), (S,) -> (S,) float32."""
    logits = np.asarray(logits, np.float32)
    peak = logits.max(axis=1, keepdims=True)
    lse = peak[:, 0] + np.log(np.sum(np.exp(logits - peak), axis=1, dtype=np.float32))
    return (logits[np.arange(len(tokens)), tokens] - lse).astype(np.float32)


# -- cuda -----------------------------------------------------------------------------------------
# One block per row; threads stride over the vocabulary, then over the row's entries.

@kernel
def apply_rules_rows(logits, temperature, params, offsets, ids, counts, bias, out):
    grid_dependency_wait()  # pdl.py: before any global read or write
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    vocab = logits.shape[1]
    for i in range(tid, vocab, cuda.blockDim.x):
        out[row, i] = logits[row, i]
    cuda.syncthreads()  # entries write ids that other threads copied
    frequency = params[row, 0]
    presence = params[row, 1]
    repetition = params[row, 2]
    for j in range(offsets[row] + tid, offsets[row + 1], cuda.blockDim.x):
        t = ids[j]
        l = out[row, t] + bias[j]
        c = counts[j]
        if c >= 0:
            l = l / repetition if l > 0 else l * repetition
            l -= frequency * float32(c)
            if c > 0:
                l -= presence
        out[row, t] = l
    min_p = params[row, 3]
    temp = temperature[row]
    if temp > 0 and min_p > 0:  # the same for the whole block: every thread reduces or none
        cuda.syncthreads()
        best = NEG_INF
        for i in range(tid, vocab, cuda.blockDim.x):
            best = max(best, out[row, i])
        floor = block_max(best) + temp * math.log(min_p)
        for i in range(tid, vocab, cuda.blockDim.x):
            if out[row, i] < floor:
                out[row, i] = NEG_INF


@kernel
def token_logprob_rows(logits, tokens, logprobs):
    grid_dependency_wait()  # pdl.py: before any global read or write
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    vocab = logits.shape[1]
    best = NEG_INF
    for i in range(tid, vocab, cuda.blockDim.x):
        best = max(best, logits[row, i])
    peak = block_max(best)
    total = float32(0.0)
    for i in range(tid, vocab, cuda.blockDim.x):
        total += math.exp(logits[row, i] - peak)
    log_norm = peak + math.log(block_sum(total))
    if tid == 0:
        logprobs[row] = logits[row, tokens[row]] - log_norm


def apply_rules_cuda(logits, temperature, params, offsets, ids, counts, bias, out, stream=0):
    """apply_rules_ref on device arrays: logits, out (S, V) float32; temperature (S,) float32;
    params (S, 4) float32; offsets (S + 1,) int32; ids, counts (H,) int32; bias (H,) float32."""
    num_rows = logits.shape[0]
    require("logits", logits, np.float32, ndim=2)
    require("out", out, np.float32, shape=tuple(logits.shape))
    require("temperature", temperature, np.float32, shape=(num_rows,))
    require("params", params, np.float32, shape=(num_rows, NUM_PARAMS))
    require("offsets", offsets, np.int32, shape=(num_rows + 1,))
    num_entries = ids.shape[0]
    require("ids", ids, np.int32, shape=(num_entries,))
    require("counts", counts, np.int32, shape=(num_entries,))
    require("bias", bias, np.float32, shape=(num_entries,))
    if num_rows:
        apply_rules_rows[num_rows, threads(MAX_THREADS), stream](logits, temperature, params, offsets, ids, counts,
                                                                 bias, out)
    return out


def token_logprobs_cuda(logits, tokens, logprobs, stream=0):
    """token_logprobs_ref on device arrays: logits (S, V) float32, tokens (S,) int32 -> logprobs (S,)."""
    num_rows = logits.shape[0]
    require("logits", logits, np.float32, ndim=2)
    require("tokens", tokens, np.int32, shape=(num_rows,))
    require("logprobs", logprobs, np.float32, shape=(num_rows,))
    if num_rows:
        token_logprob_rows[num_rows, threads(MAX_THREADS), stream](logits, tokens, logprobs)
    return logprobs


def check_rules(rules: LogitRules, num_rows: int, vocab: int) -> None:
    """Host-side bounds check before a launch: an id outside the vocabulary would write out of bounds."""
    if rules.params.shape != (num_rows, NUM_PARAMS) or rules.offsets.shape != (num_rows + 1,):
        raise ValueError(f"logit rules for {rules.params.shape[0]} rows, the step has {num_rows}")
    if int(rules.offsets[-1]) != len(rules.ids) or np.any(np.diff(rules.offsets) < 0):
        raise ValueError("logit rules: offsets do not match the entries")
    if len(rules.ids) and (int(rules.ids.min()) < 0 or int(rules.ids.max()) >= vocab):
        raise ValueError(f"logit rules: a token id outside the vocabulary of {vocab}")
    if np.any(rules.params[:, 2] <= 0):
        raise ValueError("logit rules: repetition penalty must be > 0")
