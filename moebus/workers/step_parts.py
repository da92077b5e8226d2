"""Where a spanning chunk's steps go (issue 20): the host's time by part of the step, from the step's
start to its reply. A part that ends in a host sync (``(sync)`` in its name) also holds the GPU work
enqueued before it; the parts' sum is the step. The chunk's "done" line logs each part's mean and
max a step (spanning_chunk.py).

With a profiler running in the worker (``MOEBUS_TRACE_CHUNK_STEPS``, workers/step_trace.py), each
part is also a ``record_function`` range, so that a CUPTI trace places the GPU's kernels and copies
within the parts (tools/device/gap11_trace.py)."""
from __future__ import annotations

import time

RANGES = None  # torch.profiler.record_function while a trace runs (step_trace.py), else None


class StepParts:
    def __init__(self):
        self.totals: dict[str, float] = {}  # part -> seconds over all steps
        self.most: dict[str, float] = {}  # part -> the most seconds one step spent in it
        self.steps = 0
        self.per_step: list[dict[str, float]] = []  # each step's parts (seconds), in step order
        self._step: dict[str, float] = {}
        self._part: str | None = None
        self._since = 0.0
        self._range = None

    def begin(self, name: str) -> None:
        """The part ``name`` starts now (the one running ends)."""
        now = time.perf_counter()
        self._close(now)
        self._part, self._since = name, now
        if RANGES is not None:
            self._range = RANGES(name)
            self._range.__enter__()

    def end_step(self) -> None:
        """The step is over: its parts join the totals."""
        self._close(time.perf_counter())
        self._part = None
        for name, seconds in self._step.items():
            self.totals[name] = self.totals.get(name, 0.0) + seconds
            self.most[name] = max(self.most.get(name, 0.0), seconds)
        self.per_step.append(self._step)
        self._step = {}
        self.steps += 1

    def _close(self, now: float) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._part is not None:
            self._step[self._part] = self._step.get(self._part, 0.0) + now - self._since

    def summary(self) -> str:
        """``part mean/max ms`` over the steps, in the order the parts first ran."""
        steps = max(1, self.steps)
        return ", ".join(f"{name} {1e3 * total / steps:.1f}/{1e3 * self.most[name]:.1f}"
                         for name, total in self.totals.items())

    def slowest(self, step_ms: list, count: int = 3) -> str:
        """The ``count`` slowest steps by ``step_ms`` (each step's time, in step order): ``#step ms
        (its parts over 0.5 ms, largest first)``, so a chunk's worst text gap names its cause."""
        order = sorted(range(len(step_ms)), key=lambda i: -step_ms[i])[:count]
        rows = []
        for i in order:
            parts = self.per_step[i] if i < len(self.per_step) else {}
            big = sorted(((s, n) for n, s in parts.items() if s >= 5e-4), reverse=True)
            rows.append(f"#{i + 1} {step_ms[i]:.1f} ms (" + ", ".join(f"{n} {1e3 * s:.1f}" for s, n in big) + ")")
        return "; ".join(rows)
