"""Decode steps launched while the one before still runs on the GPU (the worker's half of the
broker's look-ahead steps, broker/lookahead.py): the host work of step N+1 (its STEP decoded, its
inputs laid out and copied, the graph launched) overlaps step N's kernels, and N+1 reads the ids N
sampled straight from the device, so the GPU goes from one step to the next without waiting for
the host (vLLM's async scheduling, SGLang's overlap scheduler).

Only for a captured decode step of a stage that is the whole model, with nothing for the host to do
between the launch and the outputs: no top logprobs (read from the device logits after the step),
and an expert cache that cannot evict while the launched step runs (an eviction rewrites a slot that
step may read): see ``evicts_nothing``. Anything else runs as ``Stage.forward``.

With ``MOEBUS_CACHE_LAUNCH_AHEAD=1`` a cache that evicts launches ahead too: the admissions that a
collected step's misses start are copied only after the step in flight (ExpertCache._admit fences
them behind the compute stream's end, the in-flight step included), and the table that stops naming
their victims' slots is uploaded in stream order after that step, before the next one; so no launched
step reads a slot while it is rewritten. The host's ~2 ms between steps (the outputs, the cache's
bookkeeping) then runs while the GPU computes (fourteenth session, issue 15)."""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from moebus.workers.batch import StageOutput, StepBatch
from moebus.workers.stage import ROUTED_MAX_TOKENS, Stage

# a cache that evicts launches ahead as well (see the module doc); read at each launch
CACHE_LAUNCH_AHEAD = os.environ.get("MOEBUS_CACHE_LAUNCH_AHEAD", "1") == "1"


@dataclass
class Launched:
    step_id: int
    batch: StepBatch
    graph: object  # the CapturedStep it replays
    launch: object  # its graphs.Launch: pinned outputs and completion event
    # the expert cache's placement table as the step read it (a cache that evicts changes it before the
    # step is collected: its hits and misses are counted against this one); None: the table as it is then
    placement: np.ndarray | None = None

    def is_done(self) -> bool:
        return self.launch.is_done()


def can_launch(stage: Stage, batch: StepBatch) -> bool:
    return (stage.use_graphs and stage.is_first and stage.is_last and not batch.top_logprobs
            and batch.num_tokens <= ROUTED_MAX_TOKENS and cache_allows_launch(stage.experts))


def cache_allows_launch(experts) -> bool:
    """May a step launch while another runs, as far as the expert cache goes? Where it evicts nothing,
    or with CACHE_LAUNCH_AHEAD where no loan is held (lent slots are a prefill's scratch)."""
    return (CACHE_LAUNCH_AHEAD and getattr(experts, "loaned_from", None) is None) or evicts_nothing(experts)


def evicts_nothing(experts) -> bool:
    """Can the cache take in whatever the step in flight misses without evicting anything? Then a
    step launched meanwhile reads only slots that keep their experts: admissions go to free slots
    (which no placement entry names yet) and the entries flip in stream order after it. True when
    every expert is resident, and after a prompt loan (its evicted experts' slots are free)."""
    return len(experts.free) >= min(experts.max_admissions, experts.not_resident)


def launch(stage: Stage, batch: StepBatch, step_id: int, after: Launched | None = None) -> Launched | None:
    """Launch ``batch`` as a captured step without waiting for it; ``after``: the launched step whose
    sampled ids are this one's tokens (still running: the copy of its ids is in stream order).
    None where the step must run as ``Stage.forward`` (nothing was launched)."""
    if not can_launch(stage, batch):
        return None
    stage.check(batch)
    inputs = stage._host_inputs(batch, None)
    if after is not None:  # only the graph that ``after`` replays: a capture now would run eagerly
        if not after.graph.matches(inputs) or stage.graphs.get((batch.num_tokens, "mask" in inputs)) is not after.graph:
            return None
        if stage._graph_for(batch, inputs) is not after.graph:
            return None
        graph = after.graph
    else:
        graph = stage._graph_for(batch, inputs)
        if graph is None:
            return None
        stage.ops.begin_step()  # nothing is in flight: what an eager step left is recycled
    stage.experts.device_placement(stage.ops)
    tokens = after.graph.outputs["tokens"] if after is not None else None
    placement = stage.experts.placement.copy() if CACHE_LAUNCH_AHEAD and stage.experts.not_resident else None
    return Launched(step_id, batch, graph, graph.launch(inputs, stage._wanted(batch, False), tokens=tokens),
                    placement)


def finish(stage: Stage, launched: Launched) -> StageOutput:
    """Wait for a launched step; its outputs, with the cache told which experts it read."""
    out = launched.launch.collect()
    if "prefetch_keys" in out:  # the next layers' experts it copied ahead (workers/prefetch.py)
        stage.experts.observe_prefetch(out["prefetch_keys"], out["expert_ids"])
    if "expert_ids" in out:
        stage.experts.observe(out["expert_ids"], stage.ops, read=launched.placement)
    return stage._sample_output(launched.batch, out, False)


def decode_ahead(stage: Stage, batches: Iterable[StepBatch], step) -> Iterator[StageOutput]:
    """In-process decode with launch-ahead (LocalModel.decode): the outputs of ``batches``, steps of
    the same sequences whose tokens, from the second on, are the ids the step before sampled. Each
    step is launched before the outputs of the one before are read, so the host's work of a step
    (outputs, the cache's bookkeeping, the caller's use of the tokens, the next batch) runs while
    the GPU computes the next. A step that cannot be launched runs as ``step(batch)`` (Stage.forward
    or the model's whole step), after the step in flight has finished, with the same results."""
    running: Launched | None = None  # launched, not yet collected
    tokens = None  # the host ids of the last step that ran without launch-ahead
    try:
        for step_id, batch in enumerate(batches):
            if running is not None:
                launched = launch(stage, replace(batch, tokens=np.zeros(batch.num_tokens, np.int32)), step_id,
                                  after=running) if batch.num_tokens == running.batch.num_tokens else None
                out = finish(stage, running)
                running = launched  # before the yield: a caller that stops there leaves it in flight
                yield out
                if launched is not None:
                    continue
                tokens = out.tokens
            batch = batch if tokens is None else fed(batch, tokens)
            running = launch(stage, batch, step_id) if batch.num_tokens == batch.num_seqs else None
            if running is None:
                out = step(batch)
                tokens = out.tokens
                yield out
        if running is not None:
            out, running = finish(stage, running), None
            yield out
    finally:
        if running is not None:  # the caller stopped early: the step in flight still feeds the cache
            finish(stage, running)


def fed(batch: StepBatch, tokens) -> StepBatch:
    """``batch`` with the ids the step before it sampled as its tokens (a decode step: one each)."""
    if batch.num_tokens != len(tokens) or batch.num_seqs != len(tokens):
        raise ValueError(f"a step of {batch.num_tokens} tokens of {batch.num_seqs} sequences after a step that "
                         f"sampled {len(tokens)} ids: decode's steps take one token a sequence")
    return replace(batch, tokens=tokens)
