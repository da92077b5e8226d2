"""The prompt-path loan, in one place. A step with more tokens than the standing step scratch covers
(a long prefill) borrows scratch from the tail of the expert cache for the length of that step; if
the loan is short, the step runs in pieces of as many tokens as fit, and their outputs are put back
together as if it had run whole.

Who holds which part:
- ``ExpertCache.lend`` / ``end_loan`` takes tail slots out of service (after the admissions in flight,
  never below ``min_slots``, never memory that a shrink handed back) and puts them back;
- the backend's ``borrow`` / ``end_borrow`` serves the step's new buffers from those bytes (cuda:
  ``StepPool.loan``; cpu: nothing, its steps use host memory);
- ``Scratch`` (cache_sizing.py) says how many tokens a piece may have with so many bytes lent.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import numpy as np

from moebus.workers.batch import StageOutput, StepBatch, split_tokens


@contextlib.contextmanager
def prompt_loan(experts, ops, scratch, num_tokens: int) -> Iterator[int]:
    """Lend the cache's tail to one step of ``num_tokens``; yields the tokens one piece may have.
    The slots are back in service when the block ends, whatever it raised."""
    try:
        extra_bytes = scratch.bytes_for(num_tokens) - scratch.standing_bytes
        lo, hi = experts.lend(extra_bytes)
        ops.borrow(experts.lent_bytes(lo, hi))
        yield scratch.tokens_within((hi - lo) * experts.arena.slot_bytes)
    finally:
        ops.end_borrow()
        experts.end_loan()


def forward_in_pieces(forward: Callable, batch: StepBatch, hidden, want_logits: bool, max_piece_tokens: int,
                      is_last: bool) -> StageOutput:
    """``forward`` (Stage._forward) over pieces of at most ``max_piece_tokens``; the same output as one
    call over the whole step (each sequence samples in the piece that holds its last token)."""
    pieces = split_tokens(batch, max_piece_tokens)
    outs = [(forward(piece, None if hidden is None else hidden[tokens], want_logits), idx, ends)
            for piece, idx, ends, tokens in pieces]
    rows_per_piece = [piece.top_rows() for piece, _, _, _ in pieces]
    if not is_last:
        return StageOutput(hidden=np.concatenate([o.hidden for o, _, _ in outs]))
    merged = StageOutput()
    asked = batch.top_rows()
    for name in ("top_ids", "top_logprobs"):  # (R, n): each piece's rows are a subset of the step's
        parts = [(getattr(o, name), idx[piece_rows]) for (o, idx, _), piece_rows in zip(outs, rows_per_piece)
                 if getattr(o, name) is not None]
        if parts:
            full = np.empty((len(asked),) + parts[0][0].shape[1:], parts[0][0].dtype)
            for values, rows in parts:
                full[np.searchsorted(asked, rows)] = values
            setattr(merged, name, full)
    for name in ("tokens", "logprobs", "logits"):
        parts = [(getattr(o, name), idx, ends) for o, idx, ends in outs if getattr(o, name) is not None]
        if parts:
            full = np.empty((batch.num_seqs,) + parts[0][0].shape[1:], parts[0][0].dtype)
            for values, idx, ends in parts:
                full[idx[ends]] = values[ends]
            setattr(merged, name, full)
    return merged
