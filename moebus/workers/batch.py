"""One step's work for a stage: S sequences, each with its KV slot, the position of its first new
token and the number of new tokens (a whole prompt at prefill, 1 at decode); T = sum of lengths."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moebus.cuda.kernels.penalties import LogitRules
from moebus.workers.qwen3vl_step import check_qwen3vl_arrays, qwen3vl_within


@dataclass
class StepBatch:
    slots: np.ndarray  # (S,) int32 KV cache slot per sequence
    starts: np.ndarray  # (S,) int32 position of each sequence's first new token
    lengths: np.ndarray  # (S,) int32 new tokens per sequence
    tokens: np.ndarray | None = None  # (T,) int32, for the first stage
    temperature: np.ndarray | None = None  # (S,) float32, for the last stage; <= 0: greedy
    top_k: np.ndarray | None = None  # (S,) int32, 0: off
    top_p: np.ndarray | None = None  # (S,) float32, 1: off
    u: np.ndarray | None = None  # (S,) float32 uniform draws for sampling
    top_logprobs: int = 0  # return the n most likely ids per sequence too
    logprob_rows: np.ndarray | None = None  # (R,) the sequences that want them, ascending; None: all
    logit_rules: LogitRules | None = None  # penalties, bias, min_p; None: no row has any
    # structured outputs, for the last stage: allowed-token bitmasks (cuda/kernels/sampling.py)
    mask: np.ndarray | None = None  # (M, W) uint32, one row per constrained sequence
    mask_rows: np.ndarray | None = None  # (S,) int32 row of ``mask`` per sequence, -1: unconstrained
    extras: dict = field(default_factory=dict)
    # first stage: rows of the T tokens whose token embedding is replaced (image embeddings)
    embeds: np.ndarray | None = None  # (R, D) float32
    embed_rows: np.ndarray | None = None  # (R,) int32, distinct, in [0, T)
    # Qwen3-VL (workers/qwen3vl_step.py): M-RoPE's three positions per token (None: the token
    # positions on every axis), and DeepStack rows added to the hidden states after LM layer l < L
    rope_positions: np.ndarray | None = None  # (T, 3) int32
    deepstack: np.ndarray | None = None  # (L, R', D) float32
    deepstack_rows: np.ndarray | None = None  # (R',) int32, distinct, in [0, T)

    def __post_init__(self):
        self.slots = np.asarray(self.slots, dtype=np.int32)
        self.starts = np.asarray(self.starts, dtype=np.int32)
        self.lengths = np.asarray(self.lengths, dtype=np.int32)
        if self.tokens is not None:
            self.tokens = np.asarray(self.tokens, dtype=np.int32)
        if (self.embeds is None) != (self.embed_rows is None):
            raise ValueError("embeds and embed_rows come together")
        if self.mask is not None or self.mask_rows is not None:
            self._check_mask()
        if self.embeds is not None:
            self.embeds = np.ascontiguousarray(self.embeds, dtype=np.float32)
            self.embed_rows = np.ascontiguousarray(self.embed_rows, dtype=np.int32)
            rows = self.embed_rows
            if self.embeds.ndim != 2 or rows.shape != (self.embeds.shape[0],):
                raise ValueError(f"embeds {self.embeds.shape} and embed_rows {rows.shape} do not match")
            if len(rows) and (rows.min() < 0 or rows.max() >= self.num_tokens or len(np.unique(rows)) != len(rows)):
                raise ValueError(f"embed_rows must be distinct rows of the step's {self.num_tokens} tokens")
        check_qwen3vl_arrays(self)

    def _check_mask(self) -> None:
        if self.mask is None or self.mask_rows is None:
            raise ValueError("mask and mask_rows come together")
        mask = np.ascontiguousarray(self.mask)
        self.mask = mask.view(np.uint32) if mask.dtype == np.int32 else mask.astype(np.uint32)  # the wire's int32 bits
        self.mask_rows = np.ascontiguousarray(self.mask_rows, np.int32)
        rows = self.mask_rows
        if self.mask.ndim != 2 or rows.shape != (self.num_seqs,):
            raise ValueError(f"mask {self.mask.shape} and mask_rows {rows.shape} do not fit {self.num_seqs} sequences")
        if len(rows) and (rows.min() < -1 or rows.max() >= len(self.mask)):
            raise ValueError(f"mask_rows must be -1 or rows of the {len(self.mask)} masks")

    def mask_inputs(self) -> dict[str, np.ndarray]:
        """The masks as the sampler takes them in a step of fixed shapes: (S, W), row i the mask of
        sequence i (zeros for an unconstrained one, which reads none), so a captured graph keeps one
        layout for its batch size whichever rows are constrained. {} when no row is."""
        if self.mask is None or not np.any(self.mask_rows >= 0):
            return {}
        constrained = self.mask_rows >= 0
        full = np.zeros((self.num_seqs, self.mask.shape[1]), np.uint32)
        full[constrained] = self.mask[self.mask_rows[constrained]]
        rows = np.where(constrained, np.arange(self.num_seqs), -1).astype(np.int32)
        return {"mask": full, "mask_rows": rows}

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def token_slots(self) -> np.ndarray:
        return np.repeat(self.slots, self.lengths).astype(np.int32)

    def token_positions(self) -> np.ndarray:
        offsets = np.arange(self.num_tokens) - np.repeat(np.cumsum(self.lengths) - self.lengths, self.lengths)
        return (np.repeat(self.starts, self.lengths) + offsets).astype(np.int32)

    def last_token_index(self) -> np.ndarray:
        return (np.cumsum(self.lengths) - 1).astype(np.int32)

    def top_rows(self) -> np.ndarray:
        """The rows whose top_logprobs the step returns, ascending (none when top_logprobs is 0)."""
        if not self.top_logprobs:
            return np.zeros(0, np.int32)
        if self.logprob_rows is None:
            return np.arange(self.num_seqs, dtype=np.int32)
        return np.asarray(self.logprob_rows, np.int32)

    def sampling_arrays(self):
        s = self.num_seqs
        temperature = np.zeros(s, np.float32) if self.temperature is None else np.asarray(self.temperature, np.float32)
        top_k = np.zeros(s, np.int32) if self.top_k is None else np.asarray(self.top_k, np.int32)
        top_p = np.ones(s, np.float32) if self.top_p is None else np.asarray(self.top_p, np.float32)
        u = np.zeros(s, np.float32) if self.u is None else np.asarray(self.u, np.float32)
        return temperature, top_k, top_p, u


def select_rows(batch: StepBatch, rows) -> StepBatch:
    """The step's sequences ``rows`` (ascending) as a step of their own: their tokens, sampling,
    masks, logit rules and top-logprob requests; image rows only within a row of its own (a
    prompt's chunk: one contiguous token range). Not for Qwen3-VL steps (M-RoPE, DeepStack)."""
    rows = np.asarray(rows, np.int64)
    assert batch.rope_positions is None and batch.deepstack is None, "Qwen3-VL steps are not split by rows"
    first = np.cumsum(batch.lengths) - batch.lengths
    token_idx = np.concatenate([np.arange(first[r], first[r] + batch.lengths[r]) for r in rows]).astype(np.int64)
    images = {}
    if batch.embeds is not None:
        inside = np.isin(batch.embed_rows, token_idx)
        assert inside.sum() == 0 or len(rows) == 1, "image rows only in a row selected alone"
        offset = int(first[rows[0]]) if len(rows) == 1 else 0
        images = {"embeds": batch.embeds[inside], "embed_rows": batch.embed_rows[inside] - offset}
    temperature, top_k, top_p, u = batch.sampling_arrays()
    ends = np.ones(len(rows), bool)  # every selected row samples at its last token, as in the step
    return StepBatch(slots=batch.slots[rows], starts=batch.starts[rows], lengths=batch.lengths[rows],
                     tokens=None if batch.tokens is None else batch.tokens[token_idx], temperature=temperature[rows],
                     top_k=top_k[rows], top_p=top_p[rows], u=u[rows], top_logprobs=batch.top_logprobs,
                     logprob_rows=_rows_within(batch, rows, ends), logit_rules=None if batch.logit_rules is None
                     else batch.logit_rules.take(rows), **images, **_masks_within(batch, rows, ends))


def _embeds_within(batch: StepBatch, first_token: int, count: int) -> dict:
    """The embedding rows of tokens [first_token, first_token + count), renumbered for that piece."""
    extra = qwen3vl_within(batch, first_token, count)
    if batch.embeds is None:
        return extra
    inside = (batch.embed_rows >= first_token) & (batch.embed_rows < first_token + count)
    return {"embeds": batch.embeds[inside], "embed_rows": batch.embed_rows[inside] - first_token, **extra}


def _masks_within(batch: StepBatch, idx: np.ndarray, ends: np.ndarray) -> dict:
    """A piece's masks: those of its rows that sample in it (a row's mask is for its last token)."""
    if batch.mask is None:
        return {}
    rows = np.where(ends, batch.mask_rows[idx], -1)
    return {"mask": batch.mask, "mask_rows": rows}


def _rows_within(batch: StepBatch, idx: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """A piece's rows that want top_logprobs: those that asked and end in it (only those sample)."""
    return np.nonzero(np.isin(idx, batch.top_rows()) & ends)[0].astype(np.int32)


@dataclass
class StageOutput:
    hidden: np.ndarray | None = None  # (T, D) float32, from a stage that is not last
    tokens: np.ndarray | None = None  # (S,) int32 sampled ids, from the last stage
    logprobs: np.ndarray | None = None  # (S,) float32 log p of each sampled id (raw logits)
    top_ids: np.ndarray | None = None  # (R, n) int32 for the R rows of batch.top_rows() (top_logprobs = n)
    top_logprobs: np.ndarray | None = None  # (R, n) float32
    logits: np.ndarray | None = None  # (S, V) float32 when asked for (tests, fidelity checks)
    # rows whose feed is not done yet (a prompt chunk that spans steps, workers/spanning_chunk.py):
    # their tokens are placeholders and their keys and values are not all written
    pending_rows: np.ndarray | None = None  # (N,) int32



def split_tokens(batch: StepBatch, max_tokens: int) -> list[tuple[StepBatch, np.ndarray, np.ndarray, slice]]:
    """Consecutive pieces of at most ``max_tokens`` tokens, in token order (a sequence may span
    pieces; its KV is written by one piece before the next reads it). Each piece comes with the
    original index of each of its sequences, whether that sequence ends in it, and its token slice."""
    temperature, top_k, top_p, u = batch.sampling_arrays()
    pieces, rows, first_token = [], [], 0

    def flush():
        nonlocal rows, first_token
        if not rows:
            return
        idx = np.array([r[0] for r in rows])
        ends = np.array([r[4] for r in rows])
        lengths = np.array([r[2] for r in rows], np.int32)
        tokens = None if batch.tokens is None else np.concatenate([r[3] for r in rows])
        count = int(lengths.sum())
        piece = StepBatch(slots=batch.slots[idx], starts=np.array([r[1] for r in rows]), lengths=lengths,
                          tokens=tokens, temperature=temperature[idx], top_k=top_k[idx], top_p=top_p[idx], u=u[idx],
                          top_logprobs=batch.top_logprobs, logprob_rows=_rows_within(batch, idx, ends),
                          **_embeds_within(batch, first_token, count), **_masks_within(batch, idx, ends),
                          logit_rules=None if batch.logit_rules is None else batch.logit_rules.take(idx))
        pieces.append((piece, idx, ends, slice(first_token, first_token + count)))
        first_token += count
        rows = []

    offset = 0
    for i, (start, length) in enumerate(zip(batch.starts, batch.lengths)):
        done = 0
        while done < length:
            room = max_tokens - sum(r[2] for r in rows)
            take = min(room, int(length) - done)
            toks = None if batch.tokens is None else batch.tokens[offset + done : offset + done + take]
            rows.append((i, int(start) + done, take, toks, done + take == length))
            done += take
            if sum(r[2] for r in rows) >= max_tokens:
                flush()
        offset += int(length)
    flush()
    return pieces


def masks_of(step) -> dict:
    """The STEP message's allowed-token bitmasks (protocol.Step ``mask``, ``mask_rows``), {} when none."""
    return {} if step.mask is None else {"mask": step.mask, "mask_rows": step.mask_rows}


def logit_rules_of(step) -> LogitRules | None:
    """The STEP message's logit rules (protocol.Step ``logit_*``), None when it carries none."""
    if step.logit_params is None:
        return None
    return LogitRules.from_lengths(step.logit_params, step.logit_lengths, step.logit_ids, step.logit_counts,
                                   step.logit_bias)
