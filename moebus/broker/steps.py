"""Decode steps, seen from the broker loop: plan the next step, send each stage its STEP, route a
STEP_REPLY (on to the next stage, or its tokens to the streams), and fail the requests of a step
that cannot complete. The steps in flight themselves are broker/inflight.py's bookkeeping."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

from moebus.broker.inflight import Inflight, InflightStep
from moebus.broker.lookahead import lookahead_plan
from moebus.broker.scheduler import PlannedStep, Scheduler
from moebus.broker.stats import Stats
from moebus.broker.streaming import finite_logprob
from moebus.broker.vision_qwen3vl import step_qwen3vl
from moebus.broker.vision_requests import step_embeds
from moebus.broker.vram_control import VramControl
from moebus.broker.worker_pool import WorkerPool, WorkerState
from moebus.common.protocol import Step, StepReply

log = logging.getLogger("moebus.broker")
# issue 20: a prompt chunk the worker holds part-done goes again without its image rows (~6.2 MB at
# LLaVA's 756 x 2048, re-sent every other step before): the STEP names it (held_row) and the worker
# uses the rows it kept. On (seventeenth session's call A, with HELD_CHUNK_AHEAD: bits unchanged); 0: re-sent.
KEEP_HELD_FEED = os.environ.get("MOEBUS_KEEP_HELD_FEED", "1") == "1"


def held_row(plan: PlannedStep) -> int | None:
    """The row of ``plan`` that feeds again the prompt chunk the worker holds (Sequence.held_feed, set
    from the worker's pending reply), or None."""
    if plan.held_row is not None:  # a look-ahead step's: it carries none of that row's ids either
        return plan.held_row
    if not KEEP_HELD_FEED:
        return None
    return next((i for i, (seq, start, length) in enumerate(zip(plan.seqs, plan.starts, plan.lengths))
                 if length > 1 and seq.held_feed == int(length) and seq.fed == int(start)), None)


def step_message(step: InflightStep, hidden, num_stages: int, first_layer: int = 0) -> Step:
    """The STEP for ``step``'s current stage: token ids (and image embeddings) go to the first stage
    only, the logit rules to the last, ``hidden`` is the previous stage's output."""
    plan, first, last = step.plan, step.stage == 0, step.stage == num_stages - 1
    held = held_row(plan) if first and num_stages == 1 else None
    embeds, embed_rows = step_embeds(plan.seqs, plan.starts, plan.lengths, held) if first else (None, None)
    rules = (plan.logit_rules or {}) if last else {}
    if last and plan.masks is not None:  # structured outputs (broker/grammar_state.py)
        rules = {**rules, **plan.masks}
    return Step(step_id=step.step_id, top_logprobs=plan.top_logprobs, slots=plan.slots,
                logprob_rows=plan.logprob_rows if plan.top_logprobs else None, tokens_from=plan.tokens_from,
                tokens_rows=plan.tokens_rows, held_row=held,
                starts=plan.starts, lengths=plan.lengths,
                tokens=plan.tokens if first and plan.tokens_from is None else None,
                hidden=hidden, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p, u=plan.u,
                embeds=embeds, embed_rows=embed_rows, **rules,
                **step_qwen3vl(plan.seqs, plan.starts, plan.lengths, first_layer))  # M-RoPE, DeepStack


def pending_rows_fit(rows, plan: PlannedStep) -> bool:
    """A reply's pending rows must be rows of the step that fed part of a prompt (a decode row's
    token is never held back)."""
    if rows is None:
        return True
    return all(0 <= int(r) < len(plan.seqs) and int(plan.lengths[int(r)]) > 1 for r in rows)


class StepDriver:
    """The Broker's step methods (a mixin: the state is the Broker's, named below)."""

    pool: WorkerPool
    scheduler: Scheduler
    inflight: Inflight
    vram: VramControl
    stats: Stats
    step_ids: Iterator[int]
    settings: object

    def _dispatch(self, now: float) -> None:
        if not self.pool.all_ready():
            return
        self._send_ready_steps()  # to a stage that an aborted step left free (and still alive: ready)
        if self.vram.steps_wait(pipeline_empty=not self.inflight):  # a resize first (broker/vram_control.py)
            return
        if self.inflight.can_start():
            plan = self._plan()
            if plan is None:
                return
            if self.inflight:
                self.stats.count("pipelined_steps_total")
            self._send_step(self.inflight.start(next(self.step_ids), plan, now), None)
        self._look_ahead(now)

    def _look_ahead(self, now: float) -> None:
        """One stage and one step in flight: send the step after it now (broker/lookahead.py)."""
        if not self.settings.broker.lookahead or len(self.pool) != 1 or len(self.inflight) != 1:
            return
        previous = next(iter(self.inflight))
        plan = lookahead_plan(self.scheduler, previous.plan, previous.step_id,
                              chunks_span=self.settings.max_prefill_copy_mib_beside_decode > 0)
        if plan is not None:
            self.stats.count("lookahead_steps_total")
            if plan.held_row is not None:  # a held chunk's step among them (HELD_CHUNK_AHEAD)
                self.stats.count("held_chunk_lookahead_steps_total")
            self._send_step(self.inflight.start(next(self.step_ids), plan, now), None)

    def _plan(self) -> PlannedStep | None:
        try:
            return self.scheduler.plan(self.inflight.busy_ids(), self.inflight.num_groups)
        except Exception:  # noqa: BLE001 - which request broke the plan is unknown: the running ones fail
            log.exception("planning a step failed")
            self.stats.count("internal_errors_total")
            for seq in list(self.scheduler.running.values()):
                self._fail(seq, "internal error while planning a step; request aborted", status=500)
            return None

    def _send_step(self, step: InflightStep, hidden) -> None:
        step.message = step_message(step, hidden, len(self.pool), self.pool[step.stage].layers.start)
        step.sent_s = time.monotonic()
        if not self._send_worker(step.stage, step.message):
            self._lose(self.pool[step.stage], f"gpu{step.stage} is not connected")

    def _send_ready_steps(self) -> None:
        """Send every waiting step whose next stage is free (in the order the steps started)."""
        while (step := self.inflight.next_ready()) is not None:
            hidden, step.hidden = step.hidden, None
            self._send_step(step, hidden)

    def _on_step_reply(self, worker: WorkerState, msg: StepReply) -> None:
        step = self.inflight.answered(worker.gpu, msg.step_id)
        if step is None:
            self.stats.count("invalid_messages_total")
            return  # a stale reply (its step was aborted)
        step.compute_s += msg.compute_s
        if step.stage + 1 < len(self.pool):
            self.inflight.park(step, msg.hidden)
            self._send_ready_steps()
            return
        if msg.tokens is None or msg.logprobs is None or len(msg.tokens) != len(step.plan.seqs):
            self._abort_step(f"gpu{worker.gpu} answered the step without one token per sequence", step=step)
            return
        if not pending_rows_fit(msg.pending_rows, step.plan):
            self._abort_step(f"gpu{worker.gpu} answered the step with pending rows that are not prompt chunks "
                             "of it", step=step)
            return
        self._finish_step(step, msg)

    def _finish_step(self, step: InflightStep, msg: StepReply) -> None:
        """The last stage answered: the step's tokens join their sequences, the next STEP goes out,
        and only then do the tokens stream (their PARTIALs are off the critical path)."""
        self.inflight.finish(step)
        self._send_ready_steps()  # the last stage is free: the next micro-batch goes on before tokens stream
        now = time.monotonic()
        self.inflight.started_after(step.step_id, now)  # a look-ahead step queued behind it runs from now
        self.stats.count("steps_total")
        self.stats.observe("step_seconds", now - step.started_s)
        self.stats.observe("step_compute_seconds", step.compute_s)
        self.scheduler.last_step_s = now - step.started_s
        pending = () if msg.pending_rows is None else {int(r) for r in msg.pending_rows}
        self.scheduler.advance(step.plan, pending)
        top_row = {int(r): j for j, r in enumerate(step.plan.logprob_rows)}  # the reply's top_* rows
        if msg.top_ids is None or len(msg.top_ids) != len(top_row) or len(msg.top_logprobs) != len(top_row):
            top_row = {}  # a reply that disagrees about who asked: no top logprobs rather than wrong ones
        accepted = []
        for i, (seq, samples) in enumerate(zip(step.plan.seqs, step.plan.samples)):
            if samples and i not in pending and self.scheduler.running.get(seq.id) is seq:
                token = int(msg.tokens[i])
                accepted.append((seq, token, self._accept(seq, token, now), finite_logprob(msg.logprobs[i]),
                                 top_row.get(i)))
        # the next step needs only the accepted tokens: the stage computes it while this one streams
        self._guarded("dispatch", self._dispatch, time.monotonic(), aborts_step=True)
        for seq, token, text, logprob, row in accepted:
            if seq.finish_reason or self.scheduler.running.get(seq.id) is seq:  # not failed or dropped meanwhile
                self._stream(seq, token, text, logprob, msg, row)

    def _abort_step(self, reason: str, status: int = 500, step: InflightStep | None = None) -> None:
        """``step`` (default: every step in flight) cannot complete: its requests fail."""
        steps = self.inflight.clear() if step is None else self.inflight.discard(step)
        seqs = {seq.id: seq for s in steps for seq in s.plan.seqs}  # a look-ahead step repeats its rows
        for seq in seqs.values():
            self._fail(seq, f"{reason}; request aborted", status=status)
