"""A prompt's chunk that spans steps (issue 20). Beside decode rows, a chunk whose experts must be
copied in holds every stream for the whole copy: on the H200 (8 x 128 experts, a cache of 457 slots)
~740 experts, ~6.9 GB, a step of 110-215 ms against a decode step of ~6.5 ms. Here the stage runs
the decode rows first (their own step: their graph, as any decode step), then advances the chunk
while the experts it copies stay within a budget of bytes a step and, on a GPU, while its work stays
within ``TIME_SHARE`` times what the decode rows took (chunk_advance.py: on the H200 the copy budget
alone left steps of 40-60 ms whatever the budget) and, with ``STEP_MS``, within that long from the
step's start, and reports the chunk's row as
pending (``StageOutput.pending_rows``); the broker re-sends the same feed until the row is done
(broker/steps.py), and the stage continues what it holds for that slot, start and length.

What the stage holds between steps lives outside the step scratch (which every ``begin_step``
recycles and a prompt loan lends from the cache). A step ends a chunk's work inside a layer (the
attention costs no copies: a step that stops goes on to the next layer's attention first), so that
is the attention's sum and the MLP's input (T x D float32 each), the router's weights and the pair
outputs of the expert groups done (T x A x D), with the layer and the next expert group; where the
prompt loan covers fewer tokens than the chunk, the piece in progress too. The kernels are those of
the chunk run whole on the host-grouped path (``Stage._attend``, ``_route_on_host``, ``_moe_group``,
``_head``) over the same rows in the same layer order, each expert's pairs in one group, so its
tokens and logprobs equal those of the chunk run alone in one step, bit for bit on the cpu
(tests/workers/test_spanning_chunk.py). On cuda with bf16 experts a spanning chunk's expert groups
run on tensor cores, as the chunk run whole does (moe_prefill.HostTiles: the layer planned on the
host and gathered into tiles each step, each group's tiles multiplied once its experts are in; equal
to the whole chunk within the products' rounding, not bit for bit: the whole chunk may plan on the
device); elsewhere Stage._moe's GEMVs. Its pair outputs are the state kept, per expert group.
``warm`` runs one short chunk at a worker's start, so that the first image's chunk compiles nothing.
Here: which row spans, the chunk held between steps and when it is dropped; its work within a step
is chunk_advance.py's. With ``stage.chunk_overlap`` (MOEBUS_CHUNK_OVERLAP) a step's decode rows are
launched as their graph and read after the chunk's work is enqueued (chunk_rows.py).

Where it applies (``chosen_row``): one stage holding the whole model, a budget > 0, a step with
exactly one prompt row beside decode rows and more than ``routed_max_tokens`` tokens (a routed step
copies nothing: it reads misses in place), a cache that does not hold every expert (else nothing
changes: no extra steps), not a Qwen3-VL step (M-RoPE, DeepStack). Once held, the chunk continues
in any step that carries the same feed, alone or beside decode rows (alone: with no budget). It is
dropped when a step carries its slot with another feed, when two steps in a row do not carry it (a
look-ahead step without it comes between two that do; two mean it was cancelled or failed), when a
step carrying it runs whole, and when a step advancing it raises."""
from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR, disk_cache_counts
from moebus.workers.batch import StageOutput, StepBatch, select_rows
from moebus.workers.chunk_advance import LayerInProgress, advance, advance_in_loan
from moebus.workers.chunk_rows import finish_rows, launch_rows
from moebus.workers.moe_prefill import WARM_DENSE_ROWS, can_group_on_device, warm_dense, warm_products
from moebus.workers.step_parts import StepParts

log = logging.getLogger("moebus.stage")
MAX_ABSENT_STEPS = 1  # steps without the held chunk between two with it: the look-ahead step
# a cuda worker's stage.chunk_time_share: beside decode rows, a step's chunk work ends once it took
# this many times the decode rows' time in that step (chunk_advance.py), so such a step takes ~1 +
# this many decode steps and a group's overrun (issue 20: a text stream's gap within 2x its median,
# and the decode rows beside a chunk are slower than alone: more misses); 0: the copy budget alone
TIME_SHARE = float(os.environ.get("MOEBUS_CHUNK_TIME_SHARE", "0.5"))
# issue 20, seventeenth session: a cap on a time-bounded chunk step (beside decode rows, on a GPU), from
# the step's start: its chunk work ends by then, whatever the share allows. Call A's chunk steps took a
# median 14.1 ms: the share is of the decode rows' time, and the rows beside the chunk took ~10 ms (the
# caches missing 43 experts a step, over PCIe), so 0.5 of it let the chunk run ~5 ms more. With the cap a
# chunk's first step whose rows ran synchronously does no chunk work (its loan and setup, ~7 ms there,
# go to the next step, which launches the rows first and sets up while the GPU runs them). 0: off (the
# share alone). Off: at 11 (call C, gap17.sh's "bounded") the cycle's largest text gap 3.62x its median
# against 4.46x, but the image's first token 2,986 ms against 1,789 (93 chunk steps against 39).
STEP_MS = float(os.environ.get("MOEBUS_CHUNK_STEP_MS", "0"))
SLOW_STEP_MS = 11.0  # the "done" line counts the steps over this (2x the H200's ~5.6 ms text gap, issue 20)


@dataclass
class ChunkInProgress:
    slot: int
    start: int
    length: int
    batch: StepBatch  # the chunk's row as a step of its own
    # the pieces it runs in, one after the other (one: the whole chunk; several where the prompt loan
    # covers fewer tokens, as Stage.forward_whole would run them): fixed at its first step
    pieces: list | None = None
    piece: int = 0  # the piece in progress; its state below
    layer: int = 0  # layers of the stage done
    x: object = None  # at a layer boundary: the hidden state (None before the first layer)
    residual: object = None  # and the last layer's MLP output, still to be added
    within: LayerInProgress | None = None  # a layer whose expert groups are not all done
    steps: int = 0
    copies: int = 0  # experts copied in for it
    step_ms: list = field(default_factory=list)  # each step's host time to its reply, with the decode rows
    lent: tuple | None = None  # the cache's slots [lo, hi) lent to it as scratch, held across its steps
    staging: tuple | None = None  # the loan's top slots [lo, hi) its misses are copied into (spanning_chunk_staging.py)
    staged: object = None  # spanning_chunk_staging.StagedExperts over them (chunk_advance.chunk_experts)
    absent_steps: int = 0
    idle_steps: int = 0  # its steps that did no chunk work (the first, under STEP_MS: its rows ran synchronously)
    kept: dict = field(default_factory=dict)  # name -> a buffer outside the step scratch
    parts: StepParts = field(default_factory=StepParts)  # its steps' host time by part
    layer_entry_s: float = 0.0  # the last layer's attention and routing (a step's deadline keeps room for one)
    group_host_s: float = 0.0  # the last expert group's host time: plan, acquire, launches (chunk_advance.GROUP_HOST)
    layer_plan_s: float = 0.0  # the last group's that made its layer's plan (chunk_advance.PLAN_HOST)
    host_inputs: tuple | None = None  # (piece, its host inputs): made once a piece (chunk_advance._host_inputs)
    kernels_at: tuple = field(default_factory=disk_cache_counts)  # numba's kernels (loaded, compiled) at its start
    rows_s: float | None = None  # the decode rows' time in its last step beside them (chunk_rows.py)
    copies_from: float = 0.0  # this step: when its copies may start (after the rows launched beside its work)

    @classmethod
    def of(cls, batch: StepBatch, row: int) -> "ChunkInProgress":
        return cls(slot=int(batch.slots[row]), start=int(batch.starts[row]), length=int(batch.lengths[row]),
                   batch=select_rows(batch, [row]))

    def matches(self, batch: StepBatch, row: int) -> bool:
        """Is ``row`` of ``batch`` this chunk's feed (slot, start, length and tokens)?"""
        if (int(batch.slots[row]), int(batch.starts[row]), int(batch.lengths[row])) != (self.slot, self.start,
                                                                                         self.length):
            return False
        if batch.tokens is None or self.batch.tokens is None:
            return batch.tokens is None and self.batch.tokens is None
        first = int(np.sum(batch.lengths[:row]))
        return np.array_equal(batch.tokens[first:first + self.length], self.batch.tokens)

    def keep(self, ops, name: str, array):
        """``array`` copied into this chunk's buffer ``name`` (made on first use), which the next
        step's ``begin_step`` leaves alone."""
        buffer = self.kept.get(name)
        if buffer is array:
            return buffer
        if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
            buffer = self.kept[name] = ops.zeros(array.shape, array.dtype)
        if isinstance(buffer, np.ndarray):
            np.copyto(buffer, array)
        else:  # a device array: a copy in stream order
            buffer.copy_to_device(array, stream=ops.stream)
        return buffer


def with_held_feed(stage, msg, tokens, images: dict) -> tuple:
    """(tokens, images) of a STEP whose ``held_row`` continues the chunk ``stage`` holds: that row's
    image rows (never sent again) from what the chunk kept at its first step (``ChunkInProgress.batch``,
    freed with it), and, where the step takes its ids from an earlier one (``tokens_from``: one id a row,
    the held row's a placeholder), its token ids too. A stage that holds no such chunk fails the step:
    the broker names a row held only after this stage answered it pending."""
    row, held = int(msg.held_row), stage.chunk
    slot, start, length = int(msg.slots[row]), int(msg.starts[row]), int(msg.lengths[row])
    first = int(np.sum(msg.lengths[:row]))
    if held is None or (held.slot, held.start, held.length) != (slot, start, length) or (
            msg.tokens_from is None and not np.array_equal(tokens[first:first + length], held.batch.tokens)):
        raise ValueError(f"step {msg.step_id} continues a held prompt chunk (slot {slot}, from {start}, {length} "
                         f"tokens) that this stage does not hold")
    if msg.tokens_from is not None:
        tokens = np.concatenate([tokens[:row], held.batch.tokens, tokens[row + 1:]]).astype(np.int32)
    kept = held.batch
    if kept.embeds is None or not len(kept.embed_rows):
        return tokens, images
    rows = kept.embed_rows + first
    if images.get("embeds") is not None:
        rows = np.concatenate([images["embed_rows"], rows])
        return tokens, {**images, "embeds": np.concatenate([images["embeds"], kept.embeds]), "embed_rows": rows}
    return tokens, {**images, "embeds": kept.embeds, "embed_rows": rows.astype(np.int32)}


def note_step(stage, batch: StepBatch) -> None:
    """Every step the stage is given: drop the held chunk when this step says it will not continue,
    and return its loan when this step is a long one of others (it runs whole, on a loan of its own)."""
    held = stage.chunk
    if held is None:
        return
    rows = np.nonzero(batch.slots == held.slot)[0]
    if not len(rows):
        held.absent_steps += 1
        if held.absent_steps > MAX_ABSENT_STEPS:
            drop(stage, "absent")
    else:
        held.absent_steps = 0
        if not held.matches(batch, int(rows[0])):
            drop(stage, "another feed in its slot")
    if stage.chunk is None or stage.chunk.lent is None:
        return
    prompt_rows = np.nonzero(batch.lengths > 1)[0]
    continues = len(prompt_rows) == 1 and int(batch.slots[prompt_rows[0]]) == held.slot
    if not continues and stage.scratch is not None and batch.num_tokens > stage.scratch.tokens:
        return_loan(stage)


def release(stage) -> None:
    """Forget the held chunk and give its buffers back now (on cuda numba frees device arrays
    lazily: a GPU under a VRAM budget would count them against its cache until then; ~45 MiB at
    510 tokens x 8 choices x 2048 hidden)."""
    return_loan(stage)
    held, stage.chunk = stage.chunk, None
    if held is None or not held.kept:
        return
    on_device = not all(isinstance(buffer, np.ndarray) for buffer in held.kept.values())
    held.kept.clear()
    held.within = held.x = held.residual = None
    if on_device:
        from numba import cuda

        context = cuda.current_context()
        if hasattr(context, "deallocations"):  # not in the simulator
            context.deallocations.clear()


def drop(stage, why: str) -> None:
    held = stage.chunk
    release(stage)
    if held is not None:
        stage.chunks_dropped += 1
        log.info("a prompt chunk of %d tokens (slot %d, from %d) dropped after %d steps (%s)", held.length, held.slot,
                 held.start, held.steps, why)


def chosen_row(stage, batch: StepBatch, hidden, routed_max_tokens: int) -> int | None:
    """The row of ``batch`` to advance as a spanning chunk; None: the step runs whole."""
    if stage.chunk_copy_budget_bytes <= 0 or hidden is not None or not (stage.is_first and stage.is_last):
        return None
    if batch.rope_positions is not None or batch.deepstack is not None:
        return None
    prompt_rows = np.nonzero(batch.lengths > 1)[0]
    if len(prompt_rows) != 1:
        return None
    row = int(prompt_rows[0])
    if stage.chunk is not None and stage.chunk.matches(batch, row):
        return row
    if batch.num_seqs == 1 or batch.num_tokens <= routed_max_tokens or not stage.experts.not_resident:
        return None
    return row


def forward(stage, batch: StepBatch, row: int, want_logits: bool) -> StageOutput:
    """One step with ``row`` the spanning chunk: the other rows whole, then the chunk advanced."""
    started = time.perf_counter()
    held = stage.chunk
    if held is not None and not held.matches(batch, row):
        drop(stage, "another prompt's chunk")  # its sequence is gone: the broker re-sends a held feed
    if stage.chunk is None:
        held = stage.chunk = ChunkInProgress.of(batch, row)
        held.rows_s = getattr(stage, "replay_s", None)  # (the rows' graph replayed alone: its time)
    held.parts.begin("decode rows (sync)")
    others = np.array([r for r in range(batch.num_seqs) if r != row], np.int64)
    decode = select_rows(batch, others) if len(others) else None
    rows = None  # the rows launched, read after the chunk's work (chunk_rows.py): from the chunk's second step
    if decode is not None and held.rows_s is not None:
        from moebus.workers.stage import ROUTED_MAX_TOKENS

        rows = launch_rows(stage, decode, want_logits, ROUTED_MAX_TOKENS)
    held.copies_from = 0.0
    if rows is not None:
        decode_out, deadline = None, overlapped_deadline(stage, held, started)
    else:
        decode_out = stage.forward_whole(decode, None, want_logits) if decode is not None else None
        deadline = chunk_deadline(stage, started) if decode is not None else None
        held.rows_s = time.perf_counter() - started if decode is not None else held.rows_s
    budget = stage.chunk_copy_budget_bytes if decode is not None else None  # alone: nobody waits
    idle = rows is None and deadline is not None and STEP_MS > 0 and held.steps == 0  # (STEP_MS: once a chunk)
    held.idle_steps += idle
    try:
        chunk_out = None if idle else advance_in_loan(stage, held, budget, want_logits, deadline,
                                                      fresh=rows is not None)
    except BaseException:
        if rows is not None:  # nothing left in flight: the step fails as a whole, with the chunk's error
            with contextlib.suppress(Exception):
                rows.launch.collect()
        drop(stage, "the step failed")
        raise
    if rows is not None:
        held.parts.begin("decode rows (collect)")
        decode_out, seconds = finish_rows(stage, rows)
        held.rows_s = seconds if seconds is not None else time.perf_counter() - started
    held.parts.end_step()
    held.steps += 1
    stage.chunk_steps += 1
    held.step_ms.append(1e3 * (time.perf_counter() - started))
    if chunk_out is not None:
        staging = 0 if held.staging is None else held.staging[1] - held.staging[0]  # (release() forgets it)
        releasing = time.perf_counter()
        release(stage)
        released_ms = 1e3 * (time.perf_counter() - releasing)  # in its last step, after step_ms's figure
        stage.chunks_spanned += 1
        log.info("a prompt chunk of %d tokens (slot %d, from %d) done in %d steps, %d experts copied in; a step "
                 "%.1f / %.1f / %.1f ms (min / median / max, host time to its reply, with the decode rows); by part, "
                 "mean / max ms a step: %s; slowest steps: %s; steps over %.0f ms: %d; kernels loaded / compiled "
                 "meanwhile: %d / %d; its last step %.1f ms, then its release %.1f ms; staging slots %d", held.length,
                 held.slot, held.start, held.steps, held.copies, min(held.step_ms),
                 statistics.median(held.step_ms), max(held.step_ms), held.parts.summary(),
                 held.parts.slowest(held.step_ms), SLOW_STEP_MS, sum(ms > SLOW_STEP_MS for ms in held.step_ms),
                 *(now - then for now, then in zip(disk_cache_counts(), held.kernels_at)), held.step_ms[-1],
                 released_ms, staging)
    pieces = ([(others, decode, decode_out)] if decode is not None else []) + \
             ([(np.array([row]), held.pieces[-1] if held.pieces else held.batch, chunk_out)]
              if chunk_out is not None else [])
    return merged(batch, pieces, None if chunk_out is not None else np.array([row], np.int32), want_logits)


def chunk_deadline(stage, started: float) -> float | None:
    """When a step's chunk work must end (a ``time.perf_counter()``): ``stage.chunk_time_share``
    times what the step's decode rows took from ``started``, after them, and no later than ``STEP_MS``
    after ``started`` (``capped``); None where the share is 0 (the copy budget alone bounds the step)."""
    share = stage.chunk_time_share
    if share <= 0:
        return None
    now = time.perf_counter()
    return capped(now + share * (now - started), started)


def capped(deadline: float, started: float) -> float:
    """``deadline`` no later than ``STEP_MS`` after the step's start (where STEP_MS > 0)."""
    return deadline if STEP_MS <= 0 else min(deadline, started + STEP_MS / 1e3)


def overlapped_deadline(stage, held: ChunkInProgress, started: float) -> float | None:
    """``chunk_deadline`` for a step whose decode rows were launched, not waited for: the rows' time
    is the last step's (``held.rows_s``), so the chunk's work ends ``chunk_time_share`` times that
    after the rows would; its copies can start only once the rows are done (they wait for the
    compute stream), which ``held.copies_from`` tells the first group's bytes."""
    held.copies_from = started + held.rows_s
    share = stage.chunk_time_share
    return None if share <= 0 else capped(started + (1 + share) * held.rows_s, started)


def return_loan(stage) -> None:
    """The held chunk's loan back to the cache (its end, a resize, a step that needs a loan of its
    own); the chunk stays held and lends again at its next step."""
    held = stage.chunk
    if held is not None and held.lent is not None:
        held.lent = held.staging = None
        held.staged = None
        stage.experts.end_loan()


def merged(batch: StepBatch, pieces: list, pending_rows, want_logits: bool) -> StageOutput:
    """The step's output from its pieces (rows of the step, the piece's batch, its output); a
    pending row's token and logprob are placeholders (0), its top logprobs zeros."""
    out = StageOutput(tokens=np.zeros(batch.num_seqs, np.int32), logprobs=np.zeros(batch.num_seqs, np.float32),
                      pending_rows=pending_rows)
    asked = batch.top_rows()
    if len(asked):
        out.top_ids = np.zeros((len(asked), batch.top_logprobs), np.int32)
        out.top_logprobs = np.zeros((len(asked), batch.top_logprobs), np.float32)
    for rows, piece, piece_out in pieces:
        out.tokens[rows] = piece_out.tokens
        out.logprobs[rows] = piece_out.logprobs
        if want_logits:
            if out.logits is None:
                out.logits = np.zeros((batch.num_seqs, piece_out.logits.shape[1]), np.float32)
            out.logits[rows] = piece_out.logits
        if len(asked) and piece_out.top_ids is not None and len(piece.top_rows()):
            at = np.searchsorted(asked, rows[piece.top_rows()])
            out.top_ids[at], out.top_logprobs[at] = piece_out.top_ids, piece_out.top_logprobs
    return out


def warm(stage, num_tokens: int) -> bool:
    """Run a chunk of ``num_tokens`` (more than a routed step's) through this module once, as a
    worker's start does before its cache is sized (gpu_worker.make_cache): two calls, the first
    stopping after one expert group (the state kept across steps), the second to the sampled token,
    so that every kernel a spanning chunk runs is compiled or loaded then, not in the first image's
    steps beside text streams; on tensor cores, then its groups' products at every tile width and batch
    count up to MOEBUS_WARM_PRODUCT_TILES (moe_prefill.warm_products: cuBLAS picks a kernel by the batch
    count too and loads each at its first launch), and the dense products at every row count up to
    MOEBUS_WARM_DENSE_ROWS (moe_prefill.warm_dense: by the rows too). One token repeated: its rows
    route alike, so few experts are copied. It writes keys and values at slot 0, which no sequence
    holds yet. False where it does not apply (a stage that is not the whole model, a context too
    short, Qwen3-VL: its steps never span)."""
    if not (stage.is_first and stage.is_last) or num_tokens > stage.max_context or stage.chunk is not None \
            or stage.mrope_axes is not None:
        return False
    n = num_tokens
    batch = StepBatch(slots=[0], starts=[0], lengths=[n], tokens=np.zeros(n, np.int32),
                      temperature=np.ones(1, np.float32), top_k=np.zeros(1, np.int32), top_p=np.ones(1, np.float32),
                      u=np.full(1, 0.5, np.float32))
    chunk = stage.chunk = ChunkInProgress.of(batch, 0)
    try:
        if advance(stage, chunk, 0, False, n) is None:
            advance(stage, chunk, None, False, n)
    finally:
        release(stage)
    stage.ops.begin_step()
    if can_group_on_device(stage.ops, stage.experts, n):  # its groups' products at every batch count
        try:
            stage.warmed_products = warm_products(stage.ops, stage.cfg.hidden_size, stage.cfg.moe_intermediate_size)
        except Exception as e:  # noqa: BLE001 - a warm-up only: the first image loads them instead
            log.warning("the grouped products were not warmed (%s: %s)", type(e).__name__, e)
        stage.ops.begin_step()
    started = time.perf_counter()
    try:  # its dense products (attention's projections, the router) at every row count a step may have
        moe = [i for i in stage.layer_range if stage.cfg.is_moe_layer(i)] or list(stage.layer_range)
        dense = [w for i in sorted({moe[0], stage.layer_range[0]}) for w in stage.layers[i].values()]
        stage.warmed_dense = warm_dense(stage.ops, dense, 0, None if SIMULATOR else
                                        min(WARM_DENSE_ROWS, stage.max_context))
        if stage.warmed_dense:
            log.info("dense products warmed at every row count up to %d: %d cuBLAS calls in %.2f s",
                     min(WARM_DENSE_ROWS, stage.max_context), stage.warmed_dense, time.perf_counter() - started)
    except Exception as e:  # noqa: BLE001 - a warm-up only: the first image loads them instead
        log.warning("the dense products were not warmed (%s: %s)", type(e).__name__, e)
    stage.ops.begin_step()
    return True
