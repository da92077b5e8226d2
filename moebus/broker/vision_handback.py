"""The vision hand-back in steps. One VRAM request that frees 1.5 GB unmaps ~770 segments of 2 MiB
while no decode step may run on that worker (a cache must not shrink under a step): on the H200
that held every text stream for 77 ms, 4-5 of their inter-token gaps. So the hand-back goes as a
series of VRAM requests, each asking every GPU for at most ``vision.handback_step_mib`` more, with a
decode step between two of them whenever sequences are running (or ``MAX_PAUSE_S`` at most, so a
stall does not hold the start); the last asks the full reserves. Each goes to the workers at once,
which apply it between two of their own steps (``between_steps``, broker/vram_control.py): the
steps in flight are not drained first. Only after the last does the broker ask every worker for
INFO (an INFO sits ahead of the next step; the cold start's phase marks ask one each, as each phase
begins: broker/vision_phases.py). On the cpu device's small figures, or when no sequence
is decoding as it begins, it is one request.

Each request goes out as soon as a decode step has been sent after the previous one (in practice
when its reply comes), and a text stream waits one resize at a time. On the worker two decode steps
run between two resizes: the look-ahead step sent with the previous reply is in its inbox before the
request and is launched ahead of it (H200, eighth session: 28 requests of 64 MiB in 56 steps, 385
ms; until the seventh session the next request waited for a step to *complete* after the reply:
~3 steps a request, 980 ms). The plan starts from what each GPU already has free (its last INFO),
so no request is spent asking for room that is there.

The regrow after the worker stops goes the same way in reverse (``regrow_plan``): the reserves fall
by at most ``vision.handback_step_mib`` a request, the last one a bare VRAM (every cache back to its
start-up size). In one request it mapped ~890 segments in 57 ms beside a prompt's chunk step (H200,
tenth session): a 100 ms gap for the text streams.
"""
from __future__ import annotations

import math
import time
from typing import Callable

MAX_PAUSE_S = 0.1  # the most one step of the hand-back waits for a decode step to pass


def handback_plan(reserves: list[float | None], step_mib: float,
                  free_mib: list[float | None] | None = None) -> list[list[float | None]]:
    """The reserves of each VRAM request, evenly growing to ``reserves`` (None: a GPU's start-up
    reserve, the same in every request) from what each GPU has free now (``free_mib``, None or
    absent: nothing), at most ``step_mib`` more each."""
    free = [max(0.0, f or 0.0) for f in (free_mib or [])] + [0.0] * (len(reserves) - len(free_mib or []))
    base = [None if r is None else min(f, r) for r, f in zip(reserves, free)]
    top = max((r - b for r, b in zip(reserves, base) if r), default=0.0)
    count = max(1, math.ceil(top / step_mib))
    return [[None if r is None else b + (r - b) * (i + 1) / count for r, b in zip(reserves, base)]
            for i in range(count)]


def regrow_plan(reserves: list[float | None], step_mib: float) -> list[list[float | None]]:
    """From the reserves held now down to none in evenly falling steps of at most ``step_mib``;
    the last request a bare VRAM (None everywhere: each GPU back to its start-up size)."""
    top = max((r for r in reserves if r), default=0.0)
    count = max(1, math.ceil(top / step_mib))
    steps = [[None if r is None else r * (count - i) / count for r in reserves] for i in range(1, count)]
    return steps + [[None] * len(reserves)]


class Handback:
    """A series of the broker's own VRAM requests with a decode step between two: the hand-back
    before a start, or (``plan`` given: regrow_plan) the regrow after a stop."""

    def __init__(self, reserves: list[float | None], step_mib: float, queue_vram: Callable,
                 steps_sent: Callable[[], int], decoding: Callable[[], bool], on_done: Callable,
                 free_mib: list[float | None] | None = None, plan: list[list[float | None]] | None = None):
        """``queue_vram(reserves, on_reply)``: the broker's own VRAM fan-out; ``steps_sent()``: decode
        steps sent so far; ``decoding()``: are sequences running; ``on_done(reply)``: the last reply
        (or the first one with an error); ``free_mib``: each GPU's free MiB now (its last INFO);
        ``plan``: the requests, instead of the hand-back's to ``reserves``."""
        # with nothing decoding no stream waits on the resize: one request, the image's start sooner
        if not decoding():
            self.plan = [list(plan[-1] if plan else reserves)]
        else:
            self.plan = plan or handback_plan(reserves, step_mib, free_mib)
        self.queue_vram, self.steps_sent, self.decoding, self.on_done = queue_vram, steps_sent, decoding, on_done
        self.sent = 0
        self.sent_after = 0  # steps sent when the last request went out
        self.waiting_since: float | None = None  # when the last reply came

    def start(self) -> None:
        self._send()

    def _send(self) -> None:
        reserves = self.plan[self.sent]
        self.sent += 1
        self.sent_after = self.steps_sent()
        self.queue_vram(reserves, self._answered, interim=self.sent < len(self.plan), between_steps=True)

    def _answered(self, reply) -> None:
        if reply.error or self.sent == len(self.plan):
            self.on_done(reply)
        else:
            self.waiting_since = time.monotonic()
            self.tick(self.waiting_since)

    def tick(self, now: float) -> None:
        """On every loop turn (and at each reply): send the next request once a decode step has been
        sent since the last one (it runs between the two resizes)."""
        if self.waiting_since is None:
            return
        if not self.decoding() or self.steps_sent() > self.sent_after or now - self.waiting_since >= MAX_PAUSE_S:
            self.waiting_since = None
            self._send()
