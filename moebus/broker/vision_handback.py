"""The vision hand-back in steps. One VRAM request that frees 1.5 GB unmaps ~770 segments of 2 MiB
while no decode step may run on that worker (a cache must not shrink under a step): on the H200
that held every text stream for 77 ms, 4-5 of their inter-token gaps. So the hand-back goes as a
series of VRAM requests, each asking every GPU for at most ``vision.handback_step_mib`` more, with a
decode step between two of them whenever sequences are running (or ``MAX_PAUSE_S`` at most, so a
stall does not hold the start); the last asks the full reserves. Each goes to the workers at once,
which apply it between two of their own steps (``between_steps``, broker/vram_control.py): the
steps in flight are not drained first. Only after the last does the broker ask every worker for
INFO (an INFO sits ahead of the next step). On the cpu device's small figures, or when no sequence
is decoding as it begins, it is one request.

A text stream's gap over one step of the hand-back is a decode step plus the worker's resize: on the
H200 4.2-5.3 ms for 225 MiB steps, 0.3-2.6 ms (median 2.2) for the default 64 MiB, which leaves the
hand-back's gaps no larger than the vision worker's start's (docs/performance.md). The price is
more requests, each ~3 decode steps long (the step in flight and the look-ahead step queued before
it on the worker, then one step that must pass): 29 requests, 980 ms with 11 ms steps."""
from __future__ import annotations

import math
import time
from typing import Callable

MAX_PAUSE_S = 0.1  # the most one step of the hand-back waits for a decode step to pass


def handback_plan(reserves: list[float | None], step_mib: float) -> list[list[float | None]]:
    """The reserves of each VRAM request, evenly growing to ``reserves`` (None: a GPU's start-up
    reserve, the same in every request)."""
    top = max((r for r in reserves if r), default=0.0)
    count = max(1, math.ceil(top / step_mib))
    return [[None if r is None else r * (i + 1) / count for r in reserves] for i in range(count)]


class Handback:
    def __init__(self, reserves: list[float | None], step_mib: float, queue_vram: Callable,
                 steps_done: Callable[[], int], decoding: Callable[[], bool], on_done: Callable):
        """``queue_vram(reserves, on_reply)``: the broker's own VRAM fan-out; ``steps_done()``: steps
        completed so far; ``decoding()``: are sequences running; ``on_done(reply)``: the last reply
        (or the first one with an error)."""
        # with nothing decoding no stream waits on the resize: one request, the image's start sooner
        self.plan = handback_plan(reserves, step_mib) if decoding() else [list(reserves)]
        self.queue_vram, self.steps_done, self.decoding, self.on_done = queue_vram, steps_done, decoding, on_done
        self.sent = 0
        self.waiting_since: tuple[int, float] | None = None  # (steps done, time) when the last reply came

    def start(self) -> None:
        self._send()

    def _send(self) -> None:
        reserves = self.plan[self.sent]
        self.sent += 1
        self.queue_vram(reserves, self._answered, interim=self.sent < len(self.plan), between_steps=True)

    def _answered(self, reply) -> None:
        if reply.error or self.sent == len(self.plan):
            self.on_done(reply)
        else:
            self.waiting_since = (self.steps_done(), time.monotonic())

    def tick(self, now: float) -> None:
        """On every loop turn: send the next request once a decode step has passed."""
        if self.waiting_since is None:
            return
        steps, since = self.waiting_since
        if not self.decoding() or self.steps_done() > steps or now - since >= MAX_PAUSE_S:
            self.waiting_since = None
            self._send()
