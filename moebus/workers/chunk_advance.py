"""A prompt chunk that spans steps (spanning_chunk.py): its work within one step. Its pieces, layers
and, within a layer, expert groups run while the experts they copy in stay within the step's budget
of bytes and, beside decode rows on a GPU, of time (``deadline``): before each group after the
step's first (or after a layer's entry: its attention and routing are a step's progress too), and
before each layer's attention, the stage syncs and stops once the deadline is past (or, at a layer,
nearer than the last layer's attention and routing took; at a group, nearer than the last group's
host work took, ``GROUP_HOST``, or where it makes its layer's plan the last such group's, ``PLAN_HOST``;
a chunk's first step counts its setup as progress, ``SETUP_STEP``);
every group's copies (the first's too, at least one expert) also fit the time left at
``LINK_BYTES_PER_S``. What the next step needs is kept outside the step scratch
(``ChunkInProgress.keep``): within a layer its state, at a layer boundary the hidden state and the
last MLP's output. A chunk longer than the standing scratch holds the cache's prompt-path loan from
its first step to its end. Each part of a step is timed (step_parts.py)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moebus.workers.batch import StageOutput, StepBatch, split_tokens
from moebus.workers.moe_prefill import HostTiles, can_group_on_device
from moebus.workers.prompt_loan import forward_in_pieces
from moebus.workers.spanning_chunk_staging import STAGING_SLOTS, StagedExperts

if TYPE_CHECKING:
    from moebus.workers.spanning_chunk import ChunkInProgress

# a time-bounded step's copies: the bytes a second that the time left may still take (H200's PCIe,
# the pinned store to the arena beside decode's reads of the mapped store: ~25-50 GB/s)
LINK_BYTES_PER_S = float(os.environ.get("MOEBUS_CHUNK_LINK_GBPS", "25")) * 1e9
# a time-bounded step's next group (after its first) starts only where the time left, less the host
# time the chunk's last group took (its plan, acquire and launches: ~4.5 ms on the H200, thirteenth
# session's call 1, when the GPU is idle after the sync), is still positive, and its copies fit that
# remainder (0: the time left alone, as before: such steps overran their deadline by a group)
GROUP_HOST = os.environ.get("MOEBUS_CHUNK_GROUP_HOST", "1") == "1"  # (0 off)
# a time-bounded chunk's first step: its setup (the loan, the piece's inputs, the embedding) is that
# step's progress, so layer 0's attention and routing start in it only where the time left exceeds the
# stage's last chunk's layer entry (call 1: the first steps were the slowest, 19-20 ms, with the loan,
# the inputs, the attention and the routing's sync in one step); 0: the first layer entered regardless
SETUP_STEP = os.environ.get("MOEBUS_CHUNK_SETUP_STEP", "1") == "1"  # (0 off)
# a time-bounded step's group that makes its layer's plan (HostTiles' plan_tiles, ~1.5-2.5 ms of numpy
# for a 510-token chunk on the H200's host) after the layer's entry in the same step: it starts only
# where the time left exceeds the host time the last such group took (``layer_plan_s``), not the last
# group's (call 2: the slowest steps, 14-16 ms, were a layer's entry then its first group); 0: off
PLAN_HOST = os.environ.get("MOEBUS_CHUNK_PLAN_HOST", "0") == "1"  # (off until a GPU call measures it)


@dataclass
class LayerInProgress:
    """A layer whose experts are not all done: what its remaining groups and its end need."""
    x: object  # the residual stream after the attention's add
    h: object  # the MLP's input
    routed: object  # stage.HostRouting: the router's choices, weights and pair outputs
    next_expert: int = 0  # index into routed.unique of the first expert not computed
    tiles_plan: tuple | None = None  # HostTiles.made: the layer's host plan, made in its first step


def advance_in_loan(stage, chunk: ChunkInProgress, budget, want_logits: bool,
                    deadline: float | None = None, fresh: bool = False) -> StageOutput | None:
    """The chunk on the prompt-path loan where it is longer than the standing scratch covers, in
    pieces of as many tokens as the first step's loan covers. The cache's slots stay lent from the
    chunk's first step to its end (``hold_loan``); each step borrows them as its scratch. A loan
    taken again (after ``return_loan``) too short for the pieces: the chunk runs whole, in that
    loan's pieces, as it would have. ``fresh``: the step's pools were just recycled and work the
    chunk must not wait for is in flight (the decode rows' graph, chunk_rows.py): its first
    ``begin_step``, which syncs, is skipped."""
    staging = staging_slots(stage, budget)
    scratch = stage.scratch
    if not staging and (scratch is None or chunk.length <= scratch.tokens):
        return advance(stage, chunk, budget, want_logits, chunk.length, deadline, fresh)
    chunk.parts.begin("loan")
    max_piece_tokens = hold_loan(stage, chunk, staging)
    lo, hi = chunk.lent
    scratch_hi = hi if chunk.staging is None else chunk.staging[0]
    borrowed = scratch is not None and chunk.length > scratch.tokens and scratch_hi > lo
    if borrowed:
        stage.ops.borrow(stage.experts.lent_bytes(lo, scratch_hi))
    try:
        if chunk.pieces is not None and max_piece_tokens < max(p.num_tokens for p in chunk.pieces):
            return forward_in_pieces(stage._forward, chunk.batch, None, want_logits, max_piece_tokens, True)
        return advance(stage, chunk, budget, want_logits, max_piece_tokens, deadline, fresh)
    finally:
        chunk.parts.begin("end (sync)")
        if borrowed:
            stage.ops.end_borrow()


def staging_slots(stage, budget) -> int:
    """The staging slots a chunk's loan adds (spanning_chunk_staging.py): STAGING_SLOTS beside decode
    rows (a budget of bytes) where the cache does not hold every expert, else 0."""
    if STAGING_SLOTS <= 0 or budget is None or not stage.experts.not_resident \
            or not hasattr(stage.experts, "lend"):
        return 0
    return STAGING_SLOTS


def hold_loan(stage, chunk: ChunkInProgress, staging: int = 0) -> int:
    """Lend the cache's tail to the chunk unless it holds a loan already (prompt_loan's arithmetic);
    returns the tokens a piece may have. Held across steps, because a loan taken and returned each
    step churns the cache: its slots come back empty, the decode steps between admit experts into
    them (and their misses rise), the next step's loan waits for those copies and evicts them again
    (H200, 8 x 128 under 8 GiB, a 510-token chunk: a loan of ~42 slots, ~28 admissions and ~40 extra
    misses read over PCIe a step, ~750 MiB a step against the budget's 256). While it is held, the
    cache serves decode steps with the slots below it, and admits into those (ExpertCache._admit)."""
    experts, scratch = stage.experts, stage.scratch
    if chunk.lent is None:
        need = 0 if scratch is None else max(0, scratch.bytes_for(chunk.length) - scratch.standing_bytes)
        chunk.lent = experts.lend(need + staging * experts.arena.slot_bytes)
        lo, hi = chunk.lent  # the staging slots at the loan's top, where the loan covers the scratch too
        need_slots = -(-need // experts.arena.slot_bytes)  # (else none: shorter pieces would change its sums)
        chunk.staging = (hi - staging, hi) if staging and hi - lo >= need_slots + staging else None
    lo, hi = chunk.lent
    if chunk.staging is not None:
        hi = chunk.staging[0]
    return chunk.length if scratch is None else scratch.tokens_within((hi - lo) * experts.arena.slot_bytes)


def chunk_experts(stage, chunk: ChunkInProgress):
    """What the chunk's groups acquire from: the cache, or with staging slots in its loan the cache's
    hits and those slots for its misses (spanning_chunk_staging.StagedExperts, made once a loan)."""
    if getattr(chunk, "staging", None) is None or chunk.lent is None:
        return stage.experts
    staged = chunk.staged
    if staged is None or (staged.lo, staged.hi) != chunk.staging:
        staged = chunk.staged = StagedExperts(stage.experts, *chunk.staging)
    return staged


def advance(stage, chunk: ChunkInProgress, budget_bytes: int | None, want_logits: bool,
            max_piece_tokens: int, deadline: float | None = None, fresh: bool = False) -> StageOutput | None:
    """Run the chunk's pieces, layers and, within a layer, expert groups while the experts copied in
    this step stay within ``budget_bytes`` (None: no limit) and the work within ``deadline`` (a
    ``time.perf_counter()``; None: none); at least one group a step. The chunk's output once its
    last piece is through the last layer, else None (its state kept)."""
    if chunk.pieces is None:
        chunk.pieces = [chunk.batch] if max_piece_tokens >= chunk.length else \
            [piece for piece, _, _, _ in split_tokens(chunk.batch, max_piece_tokens)]
    spent = [0, False]  # bytes copied in this step, whether a group ran
    while True:
        is_last = chunk.piece == len(chunk.pieces) - 1
        out = _advance_piece(stage, chunk, chunk.pieces[chunk.piece], budget_bytes, spent, is_last, want_logits,
                             deadline, fresh)
        fresh = False  # a next piece in this step recycles (and syncs) as before
        if out is None or is_last:
            return out
        chunk.piece, chunk.layer, chunk.x, chunk.residual = chunk.piece + 1, 0, None, None
        if deadline is not None and spent[1] and time_left(stage, chunk, deadline) <= 0:
            return None  # the next piece from its first layer (its keys and values are the earlier pieces')


def time_left(stage, chunk: ChunkInProgress, deadline: float) -> float:
    """Seconds to ``deadline`` once the work enqueued so far is done (a host sync)."""
    chunk.parts.begin("deadline (sync)")
    stage.ops.synchronize()
    return deadline - time.perf_counter()


def _advance_piece(stage, chunk: ChunkInProgress, piece: StepBatch, budget_bytes, spent: list, is_last: bool,
                   want_logits: bool, deadline: float | None = None, fresh: bool = False):
    """One piece's layers from where it stands; None while some are left, else (last piece) the
    chunk's output, (another) True. ``fresh``: the pools were just recycled (no ``begin_step``)."""
    ops, cfg, parts = stage.ops, stage.cfg, chunk.parts
    parts.begin("begin (sync)")
    if not fresh:
        ops.begin_step()
    first = chunk.x is None and chunk.within is None  # the first layer's input is made in this step
    inputs = Uploads(ops, _host_inputs(stage, chunk, piece))
    segments = [(0, int(piece.slots[0]), int(piece.starts[0]), piece.num_tokens)]
    x, residual = chunk.x, chunk.residual
    if first:
        x = ops.embedding(stage.embed, inputs["tokens"])
        if "embeds" in inputs:
            x = ops.scatter_rows(x, inputs["embed_rows"], inputs["embeds"])
        if SETUP_STEP and deadline is not None and chunk.steps == chunk.idle_steps and chunk.piece == 0:
            spent[1] = True  # the chunk's setup is its first step's progress (SETUP_STEP)
            chunk.layer_entry_s = max(chunk.layer_entry_s, stage.chunk_layer_entry_s)
    mark = ops.layer_mark()
    try:
        while chunk.layer < len(stage.layer_range):
            n, i = chunk.layer, stage.layer_range[chunk.layer]
            if chunk.within is None:
                if deadline is not None and spent[1] and time_left(stage, chunk, deadline) < chunk.layer_entry_s:
                    _keep_boundary(ops, chunk, x, residual)
                    return None
                entered = time.perf_counter()
                w = stage.layers[i]
                parts.begin("attention")
                x, o = stage._attend(n, i, x, inputs["token_slot"], inputs["token_pos"], residual, segments)
                x, h = ops.add_rmsnorm(x, o, w["mlp_norm"], cfg.rms_norm_eps)
                if not cfg.is_moe_layer(i):
                    x, residual = x, ("dense", stage._dense_mlp(w, h))
                    chunk.layer += 1
                    ops.recycle_layer(mark, (x, residual[1], *inputs.uploaded()))
                    continue
                parts.begin("route (sync)")
                chunk.within = LayerInProgress(x, h, stage._route_on_host(i, w, h, _pair_buffer(stage, chunk)))
                chunk.layer_entry_s = time.perf_counter() - entered  # the attention's and the routing's, synced
                stage.chunk_layer_entry_s = chunk.layer_entry_s  # (the next chunk's first guess, SETUP_STEP)
                if deadline is not None:  # bounded by time, a layer's entry is the step's unit of progress too:
                    spent[1] = True  # its groups start in this step only while the deadline allows
            if not _run_groups(stage, chunk, i, budget_bytes, spent, deadline):
                _keep_within(ops, chunk)
                return None
            within, chunk.within = chunk.within, None
            x, residual = within.x, ("dense", ops.combine(within.routed.out, within.routed.weights))
            chunk.layer += 1
            ops.recycle_layer(mark, (x, residual[1], *inputs.uploaded()))
    finally:
        stage.experts.release()
    if not is_last:  # its keys and values are written: the next piece reads them
        return True
    parts.begin("head (sync)")
    out = stage._head(piece, inputs, x, residual, {})
    if piece.top_logprobs:
        out["top_ids"], out["top_logprobs"] = stage._top_logprobs(piece, out["logits"])
    host = {name: ops.to_host(out[name]) for name in ("tokens", "logprobs") + (("logits",) if want_logits else ())}
    return stage._sample_output(piece, {**out, **host}, want_logits)


class Uploads:
    """A step's inputs, each uploaded when the step first reads it: most of a time-bounded chunk's
    steps run expert groups only and read none (H200, 17:25 trace: ~10 uploads of the piece's token
    slots, positions, sampling, ... cost ~2.2 ms of host time a step in "begin (sync)" with the GPU
    idle; 190 of 200 chunk steps had no attention or head). An upload is in stream order before the
    kernels that read it, as before; taken inside the layer loop, it is kept by each layer's
``recycle_layer`` (``uploaded``). Valid until the next ``begin_step``."""

    def __init__(self, ops, host: dict):
        self.ops, self.host, self.device = ops, host, {}

    def __contains__(self, name: str) -> bool:
        return name in self.host

    def __getitem__(self, name: str):
        if name not in self.device:
            self.device[name] = self.ops.upload(self.host[name])
        return self.device[name]

    def uploaded(self) -> tuple:
        """The inputs uploaded so far: a layer's end keeps them (``recycle_layer``), since one read
        first in a layer's attention (the token slots, positions) is read again by the next layer's."""
        return tuple(self.device.values())


def _host_inputs(stage, chunk: ChunkInProgress, piece: StepBatch) -> dict:
    """The piece's host inputs (without attention tiles: the chunk's attention makes its own), made
    once for the chunk's piece: they depend on the piece alone."""
    made = chunk.host_inputs
    if made is None or made[0] is not piece:
        inputs = {name: a for name, a in stage._host_inputs(piece, None).items() if name != "attn_tiles"}
        made = chunk.host_inputs = (piece, inputs)
    return made[1]


def _pair_buffer(stage, chunk: ChunkInProgress):
    def allocate(shape, dtype):  # one for the chunk's layers, outside the step scratch
        buffer = chunk.kept.get("pairs")
        if buffer is None or buffer.shape != tuple(shape):
            buffer = chunk.kept["pairs"] = stage.ops.zeros(shape, dtype)
        return buffer
    return allocate


def _run_groups(stage, chunk: ChunkInProgress, layer: int, budget_bytes: int | None, spent: list,
                deadline: float | None = None) -> bool:
    """The layer's next expert groups within the budget and the deadline; True when its last expert
    is done."""
    within, experts = chunk.within, chunk_experts(stage, chunk)
    unique = within.routed.unique
    run = None  # this step's runner of the layer's groups, made with its first group
    while within.next_expert < len(unique):
        left = None if budget_bytes is None else budget_bytes - spent[0]
        if deadline is not None:  # (the step's first group: its work so far was synced by the routing or begin_step)
            # (the first group's copies start once the decode rows launched beside it are done: copies_from)
            if spent[1]:  # a later group: its host work runs with the GPU idle (GROUP_HOST, PLAN_HOST)
                host_s = chunk.group_host_s if GROUP_HOST else 0.0
                if PLAN_HOST and run is None and within.tiles_plan is None:
                    host_s = max(host_s, getattr(chunk, "layer_plan_s", 0.0))
                seconds = time_left(stage, chunk, deadline) - host_s
            else:
                seconds = max(0.0, deadline - max(time.perf_counter(), chunk.copies_from))
            if seconds <= 0 and spent[1]:
                return False
            left = int(seconds * LINK_BYTES_PER_S) if left is None else min(left, int(seconds * LINK_BYTES_PER_S))
        chunk.parts.begin("plan")
        planned = time.perf_counter()
        end, cost = group_end(experts, layer, unique, within.next_expert, left, must_run=not spent[1])
        if end == within.next_expert:
            return False
        planning = run is None and within.tiles_plan is None  # (this group makes the layer's plan)
        run = run or group_runner(stage, layer, within, chunk.parts, experts)
        run(within.next_expert, end)
        chunk.group_host_s = time.perf_counter() - planned
        if planning:
            chunk.layer_plan_s = chunk.group_host_s
        within.next_expert = end
        spent[0] += cost
        spent[1] = True
        chunk.copies += cost // experts.store.blob_bytes
    return True


def group_runner(stage, layer: int, within: LayerInProgress, parts=None, experts=None):
    """A function ``(first, end)`` that computes the pairs of the experts ``routed.unique[first:end]``
    into ``routed.out``: on tensor cores where the whole chunk would run there (the layer's pairs
    planned on the host in the layer's first step and gathered into tiles once a step,
    moe_prefill.HostTiles, each group's tiles then multiplied from its arena slots and its pairs'
    outputs scattered to their rows), else ``Stage._moe_group``'s GEMVs. The tiles' buffers are the
    step's: a step that continues the layer takes the layer's plan (``within.tiles_plan``: its numpy,
    ~0.2 ms for 510 tokens on the dev host) and gathers it again (two small uploads and one gather,
    no expert copies). ``parts``: the step's
    StepParts, told when a group's acquire and its kernels start. ``experts``: what the groups acquire
    from (chunk_experts; None: the stage's cache)."""
    ops, cfg, routed, h = stage.ops, stage.cfg, within.routed, within.h
    experts = stage.experts if experts is None else experts
    if not can_group_on_device(ops, experts, h.shape[0]):
        def gemvs(first: int, end: int) -> None:
            if parts is not None:
                parts.begin("groups (GEMVs)")
            stage._moe_group(layer, h, routed, first, end, experts)
        return gemvs
    ids = routed.unique[routed.pair_group_index].reshape(h.shape[0], -1)
    tiles = HostTiles(ops, experts, h, ids, cfg.hidden_size, cfg.moe_intermediate_size, within.tiles_plan)
    within.tiles_plan = tiles.made
    index = routed.pair_group_index

    def run(first: int, end: int) -> None:
        tiles.run_group(layer, first, end, parts)
        tiles.write_pairs(routed.out, np.flatnonzero((index >= first) & (index < end)))
    return run


def group_end(experts, layer: int, unique: np.ndarray, first: int, left_bytes: int | None, must_run: bool):
    """(end, bytes): the group ``unique[first:end]`` that the cache can hold at once and whose misses
    fit ``left_bytes`` (None: any); at least one expert when ``must_run``, so every step advances.
    Staged (spanning_chunk_staging.StagedExperts): at most ``max_misses`` misses."""
    limit = min(len(unique), first + max(1, experts.num_slots))
    max_misses = getattr(experts, "max_misses", None)
    end, cost, misses = first, 0, 0
    while end < limit:
        key = experts.store.key(layer, int(unique[end]))
        miss = not experts.is_hit(key) if max_misses is not None else key not in experts.key_slot
        extra = experts.store.blob_bytes if miss else 0
        if left_bytes is not None and cost + extra > left_bytes and (end > first or not must_run):
            break
        if miss and max_misses is not None and misses >= max_misses:
            break
        misses += miss
        end, cost = end + 1, cost + extra
    return end, cost


def _keep_boundary(ops, chunk: ChunkInProgress, x, residual) -> None:
    """A step that stops between layers: the hidden state and the last layer's MLP output kept."""
    chunk.x = chunk.keep(ops, "x_layer", x)
    chunk.residual = None if residual is None else ("dense", chunk.keep(ops, "residual", residual[1]))


def _keep_within(ops, chunk: ChunkInProgress) -> None:
    within = chunk.within
    within.x = chunk.keep(ops, "x", within.x)
    within.h = chunk.keep(ops, "h", within.h)
    within.routed.weights = chunk.keep(ops, "weights", within.routed.weights)
    chunk.x = chunk.residual = None
