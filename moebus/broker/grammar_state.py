"""One constrained sequence's grammar state (broker/grammar.py compiles it) and the masks of a step.

The state starts after the reasoning block: at once for a model without reasoning blocks (and for
completions); after the first ``</think>`` when the chat prompt ends inside an open block; and for a
reasoning model whose prompt does not open one (Qwen3 thinks unless told not to), the first token
may open a block (the mask allows the grammar's first tokens and every token that opens one) or
begin the answer. It advances with every accepted token and says when the grammar is complete (the
sequence then finishes with ``stop``).

Its next mask is computed on the engine's mask threads the moment a token is accepted, while the
broker streams that token and plans the next step, and while the stages run the steps of other
sequences. The scheduler gives a mask that is not ready yet a short grace (a share of a step's
time, ``Scheduler.mask_wait_s``); a sequence whose mask is still not ready sits that step out, so
a slow mask (a new lexer state can take milliseconds) delays its own sequence and not the batch.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, wait

import numpy as np

from moebus.common.tokenizer import THINK_CLOSE

log = logging.getLogger("moebus.broker")
WAITING, OPENING, ACTIVE = "waiting", "opening", "active"  # inside a reasoning block, may open one, constrained


class GrammarState:
    def __init__(self, engine, matcher, mode: str):
        """``engine``: broker/grammar.py's GrammarEngine; ``matcher``: this sequence's own."""
        self.engine = engine
        self.matcher = matcher
        self.mode = mode
        self._next: Future | None = None
        self._request()

    @property
    def is_active(self) -> bool:
        """Does the next token have a mask?"""
        return self.mode != WAITING

    def pending(self) -> Future | None:
        """The next mask while it is being computed, else None."""
        return self._next if self._next is not None and not self._next.done() else None

    def mask(self) -> np.ndarray | None:
        """The next token's allowed-token bitmask, (W,) int32 (waits for it); None when inactive."""
        return self._next.result() if self.is_active and self._next is not None else None

    def observe(self, token: int, text: str) -> bool:
        """A sampled token (``text``: the answer so far); True when the grammar is complete."""
        if self.mode == OPENING and token in self.engine.think_open_ids:
            self.mode = WAITING
            return False
        if self.mode == WAITING:
            if token == self.engine.think_close or THINK_CLOSE in text:
                self.mode = ACTIVE  # the constraint starts with the next token
                self._request()
            return False
        self.mode = ACTIVE
        if self._next is not None:  # a mask still being computed holds the matcher (RefCell in Rust)
            wait([self._next])
        if not self.matcher.consume_token(token):
            # the mask allowed only what the matcher takes: a token outside it is a bug, not the model's doing
            log.error("grammar: token %d refused (%s); the sequence ends", token, self.matcher.get_error()[:200])
            return True
        if self.matcher.is_stopped():
            return True
        self._request()
        return False

    def _request(self) -> None:
        self._next = self.engine.masks.submit(self._compute) if self.is_active else None

    def _compute(self) -> np.ndarray:
        """On a mask thread: the matcher is not touched elsewhere until this mask has been used."""
        row = np.zeros(self.engine.engine_words, np.int32)
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)  # releases the GIL
        if self.mode == OPENING:  # the answer may open a reasoning block instead
            ids = self.engine.think_open_ids
            np.bitwise_or.at(row.view(np.uint32), ids // 32, np.uint32(1) << (ids % 32).astype(np.uint32))
        return row[: self.engine.words]


def with_ready_masks(seqs: list, wait_s: float, others: bool) -> list:
    """``seqs`` less those whose mask is not ready after ``wait_s``; when nothing ``others`` could
    run either, the step waits for the masks instead (there is nothing to overlap them with)."""
    pending = [f for f in (s.grammar.pending() for s in seqs if s.grammar is not None) if f is not None]
    if not pending:
        return seqs
    wait(pending, timeout=wait_s)
    ready = [s for s in seqs if s.grammar is None or s.grammar.pending() is None]
    if ready or others:
        return ready
    wait(pending)
    return seqs


def step_masks(seqs: list, samples: list[bool]) -> dict | None:
    """The Step's ``mask`` (M, W) int32 and ``mask_rows`` (S,) int32 for the rows that sample under
    an active grammar; None when there is none (the plain path pays nothing)."""
    rows = [i for i, (s, take) in enumerate(zip(seqs, samples)) if take and s.grammar is not None and s.grammar.is_active]
    if not rows:
        return None
    mask_rows = np.full(len(seqs), -1, np.int32)
    mask_rows[rows] = np.arange(len(rows), dtype=np.int32)
    return {"mask": np.stack([seqs[i].grammar.mask() for i in rows]), "mask_rows": mask_rows}
