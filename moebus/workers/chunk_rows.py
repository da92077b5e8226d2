"""The decode rows of a spanning chunk's step launched, not waited for (issue 20; a cuda worker's
``stage.chunk_overlap``, ``MOEBUS_CHUNK_OVERLAP``): the rows' captured graph is launched (graphs.Launch:
its own pinned buffers and completion event), the chunk's host work (planning a group, its uploads and
launches, which took ~6 ms of Python a step with the GPU idle, eleventh session's trace) is done while
the GPU runs the rows, and the rows' outputs are read after the chunk's part of the step. The step's
reply waits for both anyway (one reply a step), so the rows' tokens come no later; the step takes
about the longer of the two instead of their sum.

What keeps it right: the chunk's kernels are enqueued behind the rows' graph on the one compute
stream; its expert copies wait for the compute stream's point at their acquire (ExpertCache's
fences), so a slot the rows read is not overwritten before they are done; the placement table the
rows read was uploaded before their launch; the rows' buffers are the graph's own (the chunk's first
``begin_step`` of the step, which would sync, is skipped: the pools were recycled just before the
launch). The rows' outputs (tokens, their routing for the cache's ``observe``) are read after the
chunk's work, as ``Stage._forward`` reads them after a replay.

How long the rows take (the chunk's deadline is a share of it, spanning_chunk.chunk_deadline) is
known only after them: the step uses the last step's, from CUDA events around the launch, plus its
host time; a chunk's first step the stage's last replay of a decode step (``Stage.replay_s``), or,
where there was none, runs the rows synchronously to measure them."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from moebus.workers.batch import StageOutput, StepBatch

OVERLAP = os.environ.get("MOEBUS_CHUNK_OVERLAP", "1") == "1"  # (on: docs/performance.md, 13th session)


@dataclass
class RowsInFlight:
    batch: StepBatch
    launch: object  # graphs.Launch (or a stand-in with ``collect()``)
    want_logits: bool
    host_s: float  # the launch's host time
    events: tuple | None = None  # (before, after) timing events around the launch (cuda)


def launch_rows(stage, decode: StepBatch, want_logits: bool, routed_max_tokens: int) -> RowsInFlight | None:
    """Launch ``decode`` (the step's decode rows) as its captured graph without waiting; None where
    it must run as ``Stage.forward_whole`` (no graph for it, top logprobs asked: they are read from
    the device logits after the graph, a step longer than a routed one or than the standing scratch)."""
    if not getattr(stage, "chunk_overlap", False) or decode.top_logprobs or decode.num_tokens > routed_max_tokens:
        return None
    if stage.scratch is not None and decode.num_tokens > stage.scratch.tokens:
        return None
    started = time.perf_counter()
    stage._check_bounds(decode)
    inputs = stage._host_inputs(decode, None)
    graph = stage._graph_for(decode, inputs)
    if graph is None or not hasattr(graph, "launch"):
        return None
    stage.ops.begin_step()  # nothing is in flight: the last step ended with a sync
    stage.experts.device_placement(stage.ops)
    before = _event(stage.ops)
    launch = graph.launch(inputs, stage._wanted(decode, want_logits))
    events = None if before is None else (before, _event(stage.ops))
    return RowsInFlight(decode, launch, want_logits, time.perf_counter() - started, events)


def finish_rows(stage, rows: RowsInFlight) -> tuple[StageOutput, float | None]:
    """Wait for the launched rows: (their output, as ``Stage._forward`` makes it after a replay;
    their time: the GPU's between the events plus the launch's host time, None without events)."""
    out = rows.launch.collect()
    if "prefetch_keys" in out:  # before observe: what was prefetched for these choices
        stage.experts.observe_prefetch(out["prefetch_keys"], out["expert_ids"])
    if "expert_ids" in out:
        stage.experts.observe(out["expert_ids"], stage.ops)
    seconds = None
    if rows.events is not None:
        from numba import cuda

        before, after = rows.events
        after.synchronize()
        seconds = rows.host_s + cuda.event_elapsed_time(before, after) / 1e3
    return stage._sample_output(rows.batch, out, rows.want_logits), seconds


def _event(ops):
    """A timing event recorded on ``ops``'s stream (None off a GPU)."""
    stream = getattr(ops, "stream", None)
    if stream is None or getattr(ops, "name", "") != "cuda":
        return None
    from moebus.cuda.kernels.compat import SIMULATOR

    if SIMULATOR:
        return None
    from numba import cuda

    event = cuda.event(timing=True)
    event.record(stream)
    return event
