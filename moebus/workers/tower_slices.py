"""A vision tower's forward in slices (issue 20, seventeenth session; off by default: measured on an H200 in the
twenty-fourth session, it did not lower the text streams' largest gap while the tower encodes, docs/performance.md):
LLaVA's tower cut every SLICE_LAYERS encoder layers (vision_model.py), the slices run in turn by
tower_graph.TowerGraph with a cut between them (``Pacer``: a wait for the GPU, then a pause in which a text
worker's steps have the GPU alone), eagerly (``run_slices``) and captured as one graph a slice
(``SliceChain``) launched in turn in a replay."""
from __future__ import annotations

import os
import time

# Issue 20 (seventeenth session; off by default: the H200's cold LLaVA cycle, twenty-fourth session, encode phase's
# largest gap 12.3-14.1 ms unsliced against 15.5-16.5 sliced, eager or captured by slice): > 0 cuts a tower that
# can be cut (LLaVA's, vision_model.py) into slices of this many encoder layers. Each slice's work is waited for,
# then the worker sleeps SLICE_PAUSE_MS before it launches the next: in the eager first encode and, as one graph a
# slice, in a replay. The vision worker is a CUDA context of its own beside the text worker's; without MPS the GPU
# time-slices between contexts that both have work (stream priorities act only inside a context), so a text
# decode step stretches by the tower's work that shares the GPU with it: sliced, by at most about one slice
# (and the switches its launches cause). The price: SLICE_PAUSE_MS and a sync per cut in the encode's time.
SLICE_LAYERS = int(os.environ.get("MOEBUS_TOWER_SLICE_LAYERS", "0"))
SLICE_PAUSE_MS = float(os.environ.get("MOEBUS_TOWER_SLICE_PAUSE_MS", "5"))
# "always": a sliced tower cuts in every encode; "busy": only where the vision worker saw the GPU busy as the
# encode began (vision_worker.SliceGate: NVML's utilization >= SLICE_BUSY_PERCENT, text workers decoding beside;
# a lone image keeps its time). Uncut, the slices run back to back (their graphs: one launch each more).
SLICE_WHEN = os.environ.get("MOEBUS_TOWER_SLICE_WHEN", "always")
SLICE_BUSY_PERCENT = int(os.environ.get("MOEBUS_TOWER_SLICE_BUSY_PERCENT", "25"))
# 1 (opt-in; measured, no gain: see SLICE_LAYERS): a sliced tower's new shape is not run eagerly at
# all: each slice is captured and its graph launched at once, the next slice captured while it runs
# (DeferredCapture.capture_launching).
# The GPU then gets each slice's work as one burst, a capture's host time apart (eagerly it gets a kernel at a
# time, each launch while the text worker's step runs: a context switch each), and the first encode costs about
# what the eager one did (the same launches from Python, recorded) plus the graphs' instantiation; no capture
# after the reply. A capture that fails leaves the tower eager, as ever.
SLICE_CAPTURE_FIRST = os.environ.get("MOEBUS_TOWER_SLICE_CAPTURE_FIRST", "0") == "1"


class Pacer:
    """The cuts between a sliced forward's slices: each waits for the GPU, then sleeps SLICE_PAUSE_MS
    (the time another context's work has the GPU alone); counted for the worker's log."""

    def __init__(self, backend):
        self.backend = backend
        self.on = True  # False: the slices run back to back (SLICE_WHEN "busy" and an idle GPU)
        self.reset()

    def reset(self) -> None:
        self.cuts, self.seconds = 0, 0.0

    def cut(self) -> None:
        if not self.on:
            return
        started = time.perf_counter()
        self.backend.synchronize()
        if SLICE_PAUSE_MS > 0:
            time.sleep(SLICE_PAUSE_MS / 1e3)
        self.cuts += 1
        self.seconds += time.perf_counter() - started


def run_slices(forward, inputs: dict, pacer: Pacer | None) -> dict:
    """``forward(inputs)``; a sliced forward (a list of callables over the same inputs, the last one's
    outputs the forward's: vision_model.py) runs its slices in turn with ``pacer.cut()`` between them."""
    if not isinstance(forward, (list, tuple)):
        return forward(inputs)
    outputs = None
    for i, stage in enumerate(forward):
        if i and pacer is not None:
            pacer.cut()
        outputs = stage(inputs)
    return outputs


class SliceChain:
    """A sliced forward's graphs (one a slice, captured in turn into one pool: the buffers a slice hands
    on are the model's kept ones or the pool's in its order), launched one after another on the stream
    with the owner's pacer cutting between them; the graph interface CapturedStep's graph has."""

    def __init__(self, graphs: list, owner):
        self.graphs, self.owner = graphs, owner

    def launch(self, stream) -> None:
        for i, graph in enumerate(self.graphs):
            if i and self.owner is not None:
                self.owner.pacer.cut()
            graph.launch(stream)

    def close(self) -> None:
        for graph in self.graphs:
            graph.close()
