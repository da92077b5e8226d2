"""Look-ahead steps: the next decode step planned and sent while the current one still runs, so a
stage never waits for the broker between two steps (vLLM's async scheduling, SGLang's overlap
scheduler). The broker does not know the tokens of the step in flight yet; the look-ahead STEP
names that step (``tokens_from``) and the worker, whose one stage samples them, feeds its own
sampled ids back in. The broker's hop (reply decoded, tokens accepted and streamed, next step
planned and sent) then runs beside the stage's compute instead of between two steps.

Only where the next step is certain: one stage (it samples what it embeds), every sequence of the
step in flight samples in it and will not end by length with that token, and no request waits for a
slot (it joins at the next ordinary step). A sequence with a grammar mask or logit rules (both depend
on the token in flight) sits the look-ahead step out: the step holds the other rows
(``tokens_rows`` names which of the step in flight's ids each takes), and, as the step in flight
then no longer holds every running sequence, the step after it is an ordinary one, which the sitting
sequence joins with its token and mask. So one constrained sequence costs the others the broker's
hop on every other step, not on every step. A prompt chunk that the worker holds part-done
(``Sequence.held_feed``, workers/spanning_chunk.py) sits it out too: the chunk goes again in the
ordinary step after it (``HELD_CHUNK_AHEAD``: in the look-ahead step after the one it sat out, named
by ``Step.held_row``), and its decode rows need not wait for that step's reply; so does a prompt's
last chunk beside decode rows where the worker may hold it (its token is not certain: the row may
come back pending). A sequence that ends by a stop token in the step in flight wastes its row of the
look-ahead step; its answer is dropped (the sequence is no longer running), and the KV it wrote in
its slot lies beyond what any later occupant of the slot reads before writing."""
from __future__ import annotations

import os

import numpy as np

from moebus.broker.scheduler import PlannedStep, Scheduler
from moebus.broker.sequence import Sequence


# issue 20: the held chunk's next step goes as a look-ahead step too (its feed is known: the same),
# after the decode-only step that it sat out, so the worker does not wait for that step's reply, the
# broker's hop and the chunk's STEP (a chunk step waited 3.5-4.9 ms, every other 0.1 ms, sixteenth
# session). The STEP names the held row (Step.held_row): neither its ids nor its image rows travel.
# On (seventeenth session's call A: a chunk step waited a median 0.18 ms against 3.54, the first token
# 2,027 ms against 2,326, the bits unchanged); 0: the ordinary step after the look-ahead step's reply.
HELD_CHUNK_AHEAD = os.environ.get("MOEBUS_HELD_CHUNK_AHEAD", "1") == "1"


def lookahead_plan(scheduler: Scheduler, previous: PlannedStep, previous_id: int,
                   chunks_span: bool = False) -> PlannedStep | None:
    """The step after ``previous`` (in flight, id ``previous_id``) over its rows that can take the
    token ``previous`` samples for them; None when that step is not certain (see above).
    ``chunks_span``: the worker may hold a prompt chunk part-done (a copy budget is set): a prompt
    row of ``previous`` beside decode rows may then not sample in it, and sits the step out; with
    ``HELD_CHUNK_AHEAD``, the step after that one takes the held chunk again (``held_out``)."""
    seqs = previous.seqs
    held_seq = held_out(scheduler, previous) if chunks_span and HELD_CHUNK_AHEAD else None
    if not seqs or len(seqs) + (held_seq is not None) != len(scheduler.running):
        return None
    beside_decode = chunks_span and bool(np.any(previous.lengths == 1))
    # a held chunk goes again in the next ordinary step; a last chunk beside decode rows may come back
    # pending. A chunk that is neither keeps today's rule: its row does not sample, no look-ahead
    held = [int(length) > 1 and (seq.held_feed > 0 or (beside_decode and take))
            for seq, length, take in zip(seqs, previous.lengths, previous.samples)]
    if not all(take or is_held for take, is_held in zip(previous.samples, held)):
        return None
    if scheduler.waiting and scheduler.free_slots:  # a new request joins at the next ordinary step
        return None
    if not all(_continues(scheduler, seq) for seq, is_held in zip(seqs, held) if not is_held):
        return None
    keep = [i for i, seq in enumerate(seqs) if not _sits_out(seq) and not held[i]]
    if not keep:
        return None
    rows = np.array(keep, np.int32)
    kept = [seqs[i] for i in keep]
    asked = [j for j, seq in enumerate(kept) if seq.sampling.logprobs]
    plan = PlannedStep(
        seqs=kept, samples=[True] * len(kept), slots=previous.slots[rows],
        starts=(previous.starts + previous.lengths)[rows].astype(np.int32), lengths=np.ones(len(kept), np.int32),
        tokens=np.zeros(len(kept), np.int32),  # placeholders: the stage takes the ids it sampled
        temperature=_take(previous.temperature, rows), top_k=_take(previous.top_k, rows),
        top_p=_take(previous.top_p, rows),
        u=np.array([seq.rng.random() for seq in kept], np.float32),  # each draw in its sequence's order
        top_logprobs=max((kept[j].sampling.logprobs for j in asked), default=0), logprob_rows=np.array(asked, np.int32),
        tokens_from=previous_id, tokens_rows=None if len(kept) == len(seqs) else rows)
    return plan if held_seq is None else with_held(plan, held_seq)


def held_out(scheduler: Scheduler, previous: PlannedStep) -> Sequence | None:
    """The one running sequence that ``previous`` left out because the worker holds its chunk part-done
    (it sat ``previous`` out and its last step has answered), where its next step needs nothing from the
    host (no grammar, no logit rules); None otherwise."""
    inside = {seq.id for seq in previous.seqs}
    out = [seq for seq in scheduler.running.values() if seq.id not in inside]
    if len(out) != 1:
        return None
    seq = out[0]
    return seq if seq.held_feed > 1 and not seq.finish_reason and not _sits_out(seq) else None


def with_held(plan: PlannedStep, seq: Sequence) -> PlannedStep:
    """``plan`` (a look-ahead step) with ``seq``'s held chunk as its last row, as the ordinary step
    after it would feed it (the same feed, start and draw; Scheduler.plan puts prompt rows last)."""
    n, feed = len(plan.seqs), seq.held_feed
    take = seq.fed + feed >= len(seq.prompt)
    p = seq.sampling
    logprob_rows = np.append(plan.logprob_rows, [n] if take and p.logprobs else []).astype(np.int32)
    return PlannedStep(
        seqs=plan.seqs + [seq], samples=plan.samples + [take], slots=np.append(plan.slots, seq.slot).astype(np.int32),
        starts=np.append(plan.starts, seq.fed).astype(np.int32),
        lengths=np.append(plan.lengths, feed).astype(np.int32),
        tokens=np.concatenate([plan.tokens, np.asarray(seq.next_feed(0), np.int32)]),
        temperature=np.append(plan.temperature, p.temperature).astype(np.float32),
        top_k=np.append(plan.top_k, p.top_k).astype(np.int32), top_p=np.append(plan.top_p, p.top_p).astype(np.float32),
        u=np.append(plan.u, seq.draw() if take else 0.0).astype(np.float32),
        top_logprobs=max(plan.top_logprobs, p.logprobs if take else 0), logprob_rows=logprob_rows,
        tokens_from=plan.tokens_from, held_row=n,
        tokens_rows=np.append(np.arange(n) if plan.tokens_rows is None else plan.tokens_rows, 0).astype(np.int32))


def _take(values, rows):
    return None if values is None else values[rows]


def _sits_out(seq: Sequence) -> bool:
    """Does the sequence's next step need its token in flight on the host first (its grammar mask,
    its logit rules)?"""
    return seq.grammar is not None or seq.sampling.has_logit_rules


def _continues(scheduler: Scheduler, seq: Sequence) -> bool:
    """Will ``seq`` still run after the token of the step in flight (unless that token stops it)?"""
    if scheduler.running.get(seq.id) is not seq or seq.finish_reason:
        return False
    generated = len(seq.generated) + 1  # with the token in flight
    max_tokens = seq.sampling.max_tokens
    return (max_tokens is None or generated < max_tokens) and len(seq.prompt) + generated < seq.max_context
