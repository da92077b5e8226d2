"""What a GPU worker's slow step spends its time on (issue 20, sixteenth session): in a fresh worker the text
streams' first prompt steps took 2.4-7.5 s on the H200 (fifteenth session) while the start line said every
kernel but one came from the disk cache, and full collections of ~160,000 objects followed them, the
trace of something compiled in Python. ``MOEBUS_STEP_STACKS_S=S`` (default 0: off):

- a thread samples the worker's main thread while a step has run longer than S seconds, every S seconds,
  and logs its innermost frames (``file:line function``), so the log names what the step waited on
  (numba's compiler, NVRTC, cuBLAS, a copy);
- after such a step, the numba kernels loaded from the disk cache or compiled since the last report,
  by name, so a kernel whose disk-cache key differs per process shows which one it is.

The cost while on: a step sets two attributes; the thread sleeps between samples."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

log = logging.getLogger("moebus.worker")
FRAMES_LOGGED = 6  # the innermost frames of a sample
OWN_FRAMES_LOGGED = 4  # and the innermost of moebus's own (a compile's innermost frames are all numba's)


def stacks_every_s() -> float:
    return float(os.environ.get("MOEBUS_STEP_STACKS_S", "0") or 0)


def kernel_counts(kernels) -> dict[str, tuple[int, int]]:
    """{kernel name: (variants loaded from the disk cache, variants compiled)} over numba dispatchers
    (their ``stats``; a kernel without them counts nothing)."""
    counts: dict[str, tuple[int, int]] = {}
    for k in kernels:
        stats = getattr(k, "stats", None)
        if stats is None:
            continue
        name = getattr(getattr(k, "py_func", None), "__qualname__", None) or getattr(k, "__name__", "?")
        hits, misses = counts.get(name, (0, 0))
        counts[name] = (hits + sum(stats.cache_hits.values()), misses + sum(stats.cache_misses.values()))
    return counts


def counts_since(now: dict[str, tuple[int, int]], then: dict[str, tuple[int, int]]) -> str:
    """'name +loaded/+compiled, ...' for the kernels whose counts grew ('' if none)."""
    grown = []
    for name, (hits, misses) in sorted(now.items()):
        was = then.get(name, (0, 0))
        if (hits, misses) != was:
            grown.append(f"{name} +{hits - was[0]}/+{misses - was[1]}")
    return ", ".join(grown)


def frames_of(frame, count: int = FRAMES_LOGGED, own: int = OWN_FRAMES_LOGGED) -> str:
    """The innermost ``count`` frames of ``frame``'s stack, innermost first, as 'file:line function', then
    after ' | ' the innermost ``own`` frames of files under moebus/ that are not among them."""
    stack = traceback.extract_stack(frame)[::-1]

    def named(frames) -> str:
        return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames)

    ours = [f for f in stack[count:] if f"{os.sep}moebus{os.sep}" in f.filename][:own]
    return named(stack[:count]) + (" | " + named(ours) if ours else "")


class StepWatch:
    """Around each step of one worker: ``begin(step_id)``, ``end()`` (also when the step raised)."""

    def __init__(self, who: str, every_s: float, kernels: list):
        self.who = who
        self.every_s = every_s
        self.kernels = kernels  # compat's list of every kernel the process defined (it grows)
        self.counts = kernel_counts(kernels)
        self.thread_id = threading.get_ident()  # the worker's thread: the one that runs steps
        self.step_id: int | None = None
        self.started = 0.0
        self.samples = 0
        self.stop = threading.Event()
        self.sampler = threading.Thread(target=self.sample, name=f"{who}-step-watch", daemon=True)
        self.sampler.start()

    def begin(self, step_id: int) -> None:
        self.started = time.perf_counter()
        self.step_id = step_id

    def end(self) -> None:
        step_id, self.step_id = self.step_id, None
        if (took_s := time.perf_counter() - self.started) > self.every_s:
            self.report(f"step {step_id} took {1e3 * took_s:.1f} ms")

    def report(self, what: str) -> None:
        """Log the kernels loaded or compiled since the last report."""
        now = kernel_counts(self.kernels)
        log.info("%s: %s; kernels loaded / compiled since the last report: %s", self.who, what,
                 counts_since(now, self.counts) or "none")
        self.counts = now

    def sample(self) -> None:
        while not self.stop.wait(self.every_s / 2):
            step_id, started = self.step_id, self.started
            if step_id is None or time.perf_counter() - started < self.every_s:
                continue
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            self.samples += 1
            log.info("%s: step %d running for %.0f ms: %s", self.who, step_id,
                     1e3 * (time.perf_counter() - started), frames_of(frame))
            self.stop.wait(self.every_s / 2)  # a sample every every_s while the step lasts

    def close(self) -> None:
        self.stop.set()


def from_env(who: str) -> StepWatch | None:
    """A StepWatch when MOEBUS_STEP_STACKS_S is set, else None (numba's kernels from compat)."""
    every_s = stacks_every_s()
    if every_s <= 0:
        return None
    from moebus.cuda.kernels import compat

    return StepWatch(who, every_s, compat._KERNELS)


def compiled_names() -> str:
    """': a, b' naming the numba kernels this process compiled rather than loaded from the disk cache
    ('' if none), for the worker's start line."""
    from moebus.cuda.kernels import compat

    names = [name for name, (_, compiled) in sorted(kernel_counts(compat._KERNELS).items()) if compiled]
    return f" ({', '.join(names)})" if names else ""
