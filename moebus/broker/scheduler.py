"""FIFO admission and continuous batching. Each step takes every running sequence once: decoding
ones feed their last token, prefilling ones the next chunk of their prompt within the step's token
budget, which is smaller while other sequences decode (``max_prefill_tokens_beside_decode``: a
mixed step's time is what every running stream waits between two tokens). A sequence keeps its KV
slot from admission to its end."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from moebus.broker.grammar_state import step_masks, with_ready_masks
from moebus.broker.sequence import Sequence
from moebus.common.errors import ServerBusy
from moebus.common.image_steps import image_step_tokens


@dataclass
class PlannedStep:
    seqs: list[Sequence]
    samples: list[bool]  # does this step end the sequence's feed (so its sampled token counts)?
    slots: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    u: np.ndarray
    top_logprobs: int  # n of the rows in logprob_rows (the most any of them asked for)
    logprob_rows: np.ndarray  # (R,) int32 rows that sample this step and asked for top logprobs
    logit_rules: dict[str, np.ndarray] | None = None  # the Step's logit_* arrays, when some row has rules
    masks: dict[str, np.ndarray] | None = None  # the Step's mask and mask_rows, when a row that samples is constrained
    tokens_from: int | None = None  # a look-ahead step's: the step in flight whose sampled ids it feeds (lookahead.py)
    tokens_rows: np.ndarray | None = None  # and which of those ids, row by row (None: all, in order)
    held_row: int | None = None  # a look-ahead step's row that continues the chunk the worker holds (lookahead.py)


MASK_WAIT_SHARE = 0.05  # of a step's time: what a late grammar mask may cost the other sequences
# max_prefill_tokens_beside_decode "auto" on cuda: 8 streams decoding beside an 8192-token prompt read 16
# tokens a step kept their median gap at 1.99x their gap before it (H200, 48 x 32 A3B-shaped, the chunk's
# attention on tensor cores; 32: 2.3-2.5x a step in-process), the prompt's first token after 9.2 s
AUTO_PREFILL_TOKENS_BESIDE_DECODE_CUDA = 16


def prefill_tokens_beside_decode(setting, device: str) -> int | None:
    """The ``max_prefill_tokens_beside_decode`` setting on a device: ``auto`` caps on cuda only (on
    the cpu a chunk's time is its tokens' arithmetic: small chunks only add steps)."""
    if setting == "auto":
        return AUTO_PREFILL_TOKENS_BESIDE_DECODE_CUDA if device == "cuda" else None
    return setting


class Scheduler:
    def __init__(self, max_batch: int, max_queue: int, max_step_tokens: int,
                 max_prefill_tokens_beside_decode: int | None = None):
        """``max_prefill_tokens_beside_decode``: the prompt tokens a step takes while any running
        sequence decodes (None: ``max_step_tokens`` less the decode rows, as when none decodes)."""
        self.max_queue = max_queue
        self.max_step_tokens = max_step_tokens
        self.max_prefill_tokens_beside_decode = max_prefill_tokens_beside_decode
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.free_slots = list(range(max_batch))[::-1]
        self.last_step_s = 0.0  # the last step's time from plan to tokens (broker/steps.py sets it)

    def submit(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise ServerBusy(f"server busy: {len(self.waiting)} requests waiting (max_queue)")
        self.waiting.append(seq)

    def find(self, seq_id: str) -> Sequence | None:
        return self.running.get(seq_id) or next((s for s in self.waiting if s.id == seq_id), None)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished, cancelled or failed sequence and free its slot."""
        if self.running.pop(seq.id, None) is not None:
            self.free_slots.append(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.running) or (bool(self.waiting) and bool(self.free_slots))

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            self.running[seq.id] = seq

    def plan(self, busy: set[str] = frozenset(), num_groups: int = 1) -> PlannedStep | None:
        """The next step, over the running sequences not in ``busy`` (those in a step in flight). With
        ``num_groups`` > 1 (pipelined stages) a step takes at most 1/num_groups of the running ones."""
        self._admit()
        idle = [s for s in self.running.values() if s.id not in busy]
        max_seqs = -(-len(self.running) // num_groups)
        # a constrained sequence whose next mask is late sits this step out (broker/grammar_state.py)
        decoding = with_ready_masks([s for s in idle if not s.is_prefilling], self.mask_wait_s,
                                    others=any(s.is_prefilling for s in idle))[:max_seqs]
        prefilling = [s for s in idle if s.is_prefilling][: max_seqs - len(decoding)]
        whole = max(self.max_step_tokens - len(decoding), 0)  # prompt tokens the step may take
        capped = self._prefill_budget(len(decoding))  # of them, for prompts without images
        image_more = image_step_tokens(self.max_step_tokens) - self.max_step_tokens  # an image prompt's, beyond
        chosen, feeds = [], []
        for seq in decoding + prefilling:
            feed = seq.next_feed((whole + image_more if seq.embeds is not None else min(capped, whole))
                                 if seq.is_prefilling else 1)
            if not feed:
                continue
            if seq.is_prefilling:
                beyond = max(0, len(feed) - whole)  # an image prompt's tokens past ``whole``: its extra room
                image_more -= beyond
                whole, capped = whole - len(feed) + beyond, capped - len(feed) + beyond
            chosen.append(seq)
            feeds.append(feed)
        if not chosen:
            return None
        samples = [seq.fed + len(feed) >= len(seq.prompt) for seq, feed in zip(chosen, feeds)]
        sp = [seq.sampling for seq in chosen]
        asked = [i for i, (p, take) in enumerate(zip(sp, samples)) if take and p.logprobs]
        return PlannedStep(
            seqs=chosen, samples=samples,
            slots=np.array([s.slot for s in chosen], np.int32),
            starts=np.array([s.fed for s in chosen], np.int32),
            lengths=np.array([len(f) for f in feeds], np.int32),
            tokens=np.array([t for f in feeds for t in f], np.int32),
            temperature=np.array([p.temperature for p in sp], np.float32),
            top_k=np.array([p.top_k for p in sp], np.int32),
            top_p=np.array([p.top_p for p in sp], np.float32),
            # the draw is consumed only when the token counts, so chunking never shifts a seed's stream
            u=np.array([s.draw() if take else 0.0 for s, take in zip(chosen, samples)], np.float32),
            top_logprobs=max((sp[i].logprobs for i in asked), default=0),
            logprob_rows=np.array(asked, np.int32), logit_rules=logit_rules(chosen, samples),
            masks=step_masks(chosen, samples))

    def _prefill_budget(self, num_decoding: int) -> int:
        """Prompt tokens this step may take. While a sequence decodes (in this step, or in another
        micro-batch that waits behind this one on a stage) a long chunk would stretch its gap, so
        ``max_prefill_tokens_beside_decode`` caps it. Not for a prompt with images (the caller): a
        step holding image embeddings is never captured (Stage._graph_for), so small chunks of it
        would each pay an eager step, and its experts' copies are bounded by the chunk that spans
        steps (max_prefill_copy_mib_beside_decode) instead."""
        budget = max(self.max_step_tokens - num_decoding, 0)
        cap = self.max_prefill_tokens_beside_decode
        if cap is not None and any(not s.is_prefilling for s in self.running.values()):
            budget = min(budget, cap)
        return budget

    @property
    def mask_wait_s(self) -> float:
        """How long a step waits for a late mask before its sequence sits out: a share of a step."""
        return MASK_WAIT_SHARE * self.last_step_s

    def advance(self, step: PlannedStep, pending_rows=()) -> None:
        """The step's tokens are now in every stage's KV cache, but those of ``pending_rows``: a chunk
        the worker holds part-done (workers/spanning_chunk.py), whose feed goes again as it was."""
        pending = {int(r) for r in pending_rows}
        for i, (seq, length) in enumerate(zip(step.seqs, step.lengths)):
            if i in pending:
                seq.held_feed = int(length)
                seq.held_draw = float(step.u[i]) if step.samples[i] else None
                continue
            seq.fed += int(length)
            if length > 1 or seq.held_feed:
                seq.held_feed, seq.held_draw = 0, None


def logit_rules(seqs: list[Sequence], samples: list[bool]) -> dict[str, np.ndarray] | None:
    """The Step's ``logit_*`` arrays (protocol.Step), None when no row that samples has a rule (the
    plain path then pays nothing). A row that does not sample this step gets no entries."""
    if not any(take and s.sampling.has_logit_rules for s, take in zip(seqs, samples)):
        return None
    empty = (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))
    entries = [s.logit_entries() if take and s.sampling.has_logit_rules else empty for s, take in zip(seqs, samples)]
    sp = [s.sampling for s in seqs]
    return {"logit_params": np.array([[p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_p]
                                      for p in sp], np.float32).reshape(len(seqs), 4),
            "logit_lengths": np.array([len(e[0]) for e in entries], np.int32),
            "logit_ids": np.concatenate([e[0] for e in entries]).astype(np.int32),
            "logit_counts": np.concatenate([e[1] for e in entries]).astype(np.int32),
            "logit_bias": np.concatenate([e[2] for e in entries]).astype(np.float32)}
