"""Look-ahead steps: the next decode step planned and sent while the current one still runs, so a
stage never waits for the broker between two steps (vLLM's async scheduling, SGLang's overlap
scheduler). The broker does not know the tokens of the step in flight yet; the look-ahead STEP
names that step (``tokens_from``) and the worker, whose one stage samples them, feeds its own
sampled ids back in. The broker's hop (reply decoded, tokens accepted and streamed, next step
planned and sent) then runs beside the stage's compute instead of between two steps.

Only where the next step is certain: one stage (it samples what it embeds), every sequence of the
step in flight samples in it, will not end by length with that token, has no grammar mask and no
logit rules (both depend on the token), and no request waits for a slot (it joins at the next
ordinary step). A sequence that ends by a stop token in the step in flight wastes its row of the
look-ahead step; its answer is dropped (the sequence is no longer running), and the KV it wrote in
its slot lies beyond what any later occupant of the slot reads before writing."""
from __future__ import annotations

import numpy as np

from moebus.broker.scheduler import PlannedStep, Scheduler
from moebus.broker.sequence import Sequence


def lookahead_plan(scheduler: Scheduler, previous: PlannedStep, previous_id: int) -> PlannedStep | None:
    """The step after ``previous`` (in flight, id ``previous_id``) over the same rows, each feeding
    the token ``previous`` samples for it; None when that step is not certain (see above)."""
    seqs = previous.seqs
    if not seqs or not all(previous.samples) or len(seqs) != len(scheduler.running):
        return None
    if scheduler.waiting and scheduler.free_slots:  # a new request joins at the next ordinary step
        return None
    if not all(_continues(scheduler, seq) for seq in seqs):
        return None
    sp = [seq.sampling for seq in seqs]
    asked = [i for i, p in enumerate(sp) if p.logprobs]
    num_seqs = len(seqs)
    return PlannedStep(
        seqs=list(seqs), samples=[True] * num_seqs, slots=previous.slots,
        starts=(previous.starts + previous.lengths).astype(np.int32), lengths=np.ones(num_seqs, np.int32),
        tokens=np.zeros(num_seqs, np.int32),  # placeholders: the stage takes the ids it sampled
        temperature=previous.temperature, top_k=previous.top_k, top_p=previous.top_p,
        u=np.array([seq.rng.random() for seq in seqs], np.float32),  # each draw in its sequence's order
        top_logprobs=max((sp[i].logprobs for i in asked), default=0), logprob_rows=np.array(asked, np.int32),
        tokens_from=previous_id)


def _continues(scheduler: Scheduler, seq: Sequence) -> bool:
    """Will ``seq`` still run after the token of the step in flight (unless that token stops it)?"""
    if scheduler.running.get(seq.id) is not seq or seq.finish_reason:
        return False
    if seq.grammar is not None or seq.sampling.has_logit_rules:
        return False
    generated = len(seq.generated) + 1  # with the token in flight
    max_tokens = seq.sampling.max_tokens
    return (max_tokens is None or generated < max_tokens) and len(seq.prompt) + generated < seq.max_context
