"""The decode steps in flight through the stages. Unpipelined, one step at a time travels
gpu0 -> gpu1 -> ...; pipelined (``broker.pipeline``, 2+ stages, 2+ running sequences) the running
sequences are split into micro-batches and up to one step per stage is in flight, so stage 0 computes
step n+1 of one group while stage 1 computes step n of another.

Invariants that keep every request's result exactly that of the unpipelined run:
- a sequence is in at most one step in flight (the scheduler plans only sequences not in one), so
  its own steps reach every stage in order and its seeded draws are taken in the same order;
- a stage computes at most one step at a time: a step whose stage answered waits here, hidden state
  in hand, until the next stage is free (so a step deadline runs only while a stage really has it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebus.broker.scheduler import PlannedStep
from moebus.common.protocol import Step


@dataclass
class InflightStep:
    step_id: int
    plan: PlannedStep
    stage: int  # the stage computing it, or (``waiting``) the one that computed it last
    started_s: float
    compute_s: float = 0.0  # summed over the stages
    sent_s: float = 0.0  # when the current stage was sent its STEP (its deadline runs from here)
    message: Step | None = None  # the current stage's STEP, re-sent if a reconnect lost it
    waiting: bool = False  # its stage answered; it waits for the next stage to be free
    hidden: np.ndarray | None = None  # what it carries to the next stage while waiting


class Inflight:
    """Every step in flight, by id, with which stage has which."""

    def __init__(self, num_stages: int, pipeline: bool):
        self.num_stages = num_stages
        self.is_pipelined = pipeline and num_stages > 1
        self.steps: dict[int, InflightStep] = {}  # in start order: the oldest waiting step goes first

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(list(self.steps.values()))

    @property
    def num_groups(self) -> int:
        """Micro-batches the running sequences are split into (one per stage when pipelined)."""
        return self.num_stages if self.is_pipelined else 1

    def can_start(self) -> bool:
        """May a new step be sent to stage 0 now?"""
        if not self.is_pipelined:
            return not self.steps
        return len(self.steps) < self.num_stages and self.at_stage(0) is None

    def start(self, step_id: int, plan: PlannedStep, now: float) -> InflightStep:
        step = InflightStep(step_id, plan, stage=0, started_s=now)
        self.steps[step_id] = step
        return step

    def busy_ids(self) -> set[str]:
        """Ids of the sequences in some step in flight: the next plan leaves them out."""
        return {seq.id for step in self.steps.values() for seq in step.plan.seqs}

    def at_stage(self, stage: int) -> InflightStep | None:
        """The step that ``stage`` is computing now."""
        return next((s for s in self.steps.values() if s.stage == stage and not s.waiting), None)

    def answered(self, stage: int, step_id: int) -> InflightStep | None:
        """The step a STEP_REPLY from ``stage`` answers; None for a stale reply."""
        step = self.steps.get(step_id)
        return step if step is not None and step.stage == stage and not step.waiting else None

    def park(self, step: InflightStep, hidden: np.ndarray) -> None:
        """``step``'s stage answered but the next stage is busy: hold its hidden state until then."""
        step.waiting, step.hidden = True, hidden

    def next_ready(self) -> InflightStep | None:
        """The oldest waiting step whose next stage is free, moved to that stage (its hidden state
        still in ``hidden`` for the caller to send)."""
        for step in self.steps.values():
            if step.waiting and self.at_stage(step.stage + 1) is None:
                step.stage, step.waiting = step.stage + 1, False
                return step
        return None

    def finish(self, step: InflightStep) -> None:
        """``step`` is answered by its last stage: out of flight (a look-ahead step after it stays)."""
        self.steps.pop(step.step_id, None)

    def discard(self, step: InflightStep) -> list[InflightStep]:
        """Take ``step`` out of flight with the look-ahead steps that feed on its tokens (their
        stage cannot run them without it): [step, ...], or [] when it was no longer in flight."""
        if self.steps.pop(step.step_id, None) is None:
            return []
        after = next((s for s in self.steps.values() if s.plan.tokens_from == step.step_id), None)
        return [step] + (self.discard(after) if after is not None else [])

    def started_after(self, step_id: int, now: float) -> None:
        """Step ``step_id`` is answered: a look-ahead step that waited behind it at its stage starts
        now (its deadline and its step time run from here)."""
        for step in self.steps.values():
            if step.plan.tokens_from == step_id:
                step.started_s = step.sent_s = now

    def all_at_stage(self, stage: int) -> list[InflightStep]:
        """Every step sent to ``stage`` and not answered, oldest first (a look-ahead step waits there)."""
        return [s for s in self.steps.values() if s.stage == stage and not s.waiting]

    def clear(self) -> list[InflightStep]:
        steps, self.steps = list(self.steps.values()), {}
        return steps

    def overdue(self, now: float, timeout_s: float) -> list[InflightStep]:
        return [s for s in self.steps.values() if not s.waiting and now - s.sent_s > timeout_s]

    def forgive(self, now: float) -> None:
        """After the broker itself stalled: no stage could be heard, so deadlines restart."""
        for step in self.steps.values():
            step.sent_s = max(step.sent_s, now)
