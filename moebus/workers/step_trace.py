"""A CUPTI trace of a worker's steps through a prompt chunk beside decode rows (issue 20 item 3),
for measurement only (tools/device/gap11.sh). With ``MOEBUS_TRACE_CHUNK_STEPS=N`` a cuda worker runs
torch.profiler from the first step that finds a spanning chunk held (its second step) until its
prompt's request is over, N steps at most (the chunk's, the steps between, the prompt's decode
steps; ``StepTrace.before``). Each step is a ``record_function`` range ``step <id> <kind>
<tokens>``, and so is each part of the chunk's steps (step_parts.py). Then it writes the chrome trace
to ``$MOEBUS_TRACE_DIR/chunk_trace_gpu<g>.json`` (default /tmp) and logs one line;
tools/device/gap11_trace.py reads it. torch is imported, and the profiler started and stopped once
empty, at the worker's start (before READY), so the traced steps pay neither. The trace's own cost
lands in the steps it covers: their times are not the untraced ones."""
from __future__ import annotations

import logging
import os
import time

import numpy as np

from moebus.workers import step_parts

log = logging.getLogger("moebus.worker")
ABSENT_STEPS = 3  # the trace stops after this many steps in a row without its prompt's slot


def from_env(gpu: int, routed_max_tokens: int):
    """The worker's StepTrace when ``MOEBUS_TRACE_CHUNK_STEPS`` asks for one and torch is there."""
    steps = int(os.environ.get("MOEBUS_TRACE_CHUNK_STEPS", "0") or 0)
    if steps <= 0:
        return None
    try:
        return StepTrace(steps, os.environ.get("MOEBUS_TRACE_DIR", "/tmp"), gpu, routed_max_tokens)
    except Exception as e:  # noqa: BLE001 - a trace is optional: the worker serves without it
        log.warning("gpu%d: no step trace (%s: %s)", gpu, type(e).__name__, e)
        return None


def step_kind(lengths, routed_max_tokens: int) -> str:
    lengths = np.asarray(lengths)
    if int(lengths.max()) == 1:
        return "decode"
    if len(lengths) > 1 and int(lengths.max()) > routed_max_tokens:
        return "chunk"
    return "prompt"


class StepTrace:
    def __init__(self, steps: int, directory: str, gpu: int, routed_max_tokens: int):
        from torch.profiler import ProfilerActivity, profile, record_function

        self.steps, self.gpu, self.routed_max_tokens = steps, gpu, routed_max_tokens
        self.path = os.path.join(directory, f"chunk_trace_gpu{gpu}.json")
        self._profile = lambda: profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._record_function = record_function
        started = time.perf_counter()
        warm = self._profile()  # CUPTI's first start is slow: here, not in a traced step
        warm.start()
        warm.stop()
        self.prof = None
        self.absent = 0  # steps in a row without the traced prompt's slot, no chunk held
        self.traced = 0
        self.done = False
        self._range = None
        log.info("gpu%d: a trace of up to %d steps from the first spanning chunk's second step, to %s (profiler "
                 "warmed in %.2f s)", gpu, steps, self.path, time.perf_counter() - started)

    def before(self, step_id: int, slots, lengths, chunk_slot: int | None) -> None:
        """A step starts; ``chunk_slot``: the slot of the spanning chunk the stage holds, or None.
        The trace starts at the first step that finds one held (its second step, not a text
        stream's own prompt beside the others) and stops before the ABSENT_STEPS-th step in a row
        without that slot once no chunk is held (the prompt's request is over: the stop's seconds
        fall outside the window of its gaps; between two chunks of one prompt a look-ahead step
        may leave the slot out once), or after ``steps`` steps."""
        if self.prof is None:
            if self.done or chunk_slot is None:
                return
            started = time.perf_counter()
            self.prof = self._profile()
            self.prof.start()
            step_parts.RANGES = self._record_function
            self.slot = chunk_slot
            log.info("gpu%d: trace started at step %d (%.1f ms)", self.gpu, step_id,
                     1e3 * (time.perf_counter() - started))
        else:
            gone = chunk_slot is None and self.slot not in np.asarray(slots).tolist()
            self.absent = self.absent + 1 if gone else 0
            if self.traced >= self.steps or self.absent >= ABSENT_STEPS:
                self._stop()
                return
        kind = step_kind(lengths, self.routed_max_tokens)
        self._range = self._record_function(f"step {step_id} {kind} {int(np.sum(lengths))}")
        self._range.__enter__()

    def after(self) -> None:
        if self._range is None:
            return
        self._range.__exit__(None, None, None)
        self._range = None
        self.traced += 1

    def _stop(self) -> None:
        step_parts.RANGES = None
        started = time.perf_counter()
        prof, self.prof, self.done = self.prof, None, True
        prof.stop()
        prof.export_chrome_trace(self.path)
        log.info("gpu%d: %d steps traced to %s (%.2f s to stop and write)", self.gpu, self.traced, self.path,
                 time.perf_counter() - started)
