"""Misses under compute: during decode layer L, on a second branch of the step (graphs.SideBranch),
layer L+1's router ranks layer L's MLP input, and the predicted experts of L+1 that are not resident
are copied from the mapped host store into a bank of reserved arena slots; layer L+1's pairs then
read those experts from VRAM, and the rest in place as before (cuda/kernels/prefetch.py). Where the
layer's experts run in tiles on tensor cores (many tokens, moe_prefill.grouped_moe_placed), the tiles
plan from a copy of the layer's placement row with the prefetched experts pointing at their slots.

Two banks of ``slots_per_layer`` slots, the arena's first slots (the cache never places an expert
there, see ExpertCache.num_reserved): layer row r fills bank r % 2 while the experts of row r - 1
read bank (r - 1) % 2, so a copy never overwrites a slot still being read. ``keys`` (L, K) on the
device says which host-store row each bank slot holds for each layer row in this step (-1: none);
row 0 is never prefetched (nothing runs before it), and every other row is written afresh by every
step, so nothing is stale from one step to the next. The keys come back with the step's results for
the counters: prefetched, used (chosen by the layer after all) and wasted experts.

A layer is cheap to predict from the one before it (the top-8 so predicted held 0.846 of the experts
then chosen on a 48 x 32 A3B-shaped model: docs/performance.md), and a bank is capped at what PCIe
brings in about one layer's time, since the next layer waits for the copies at the join."""
from __future__ import annotations

import os

import numpy as np

from moebus.cuda.kernels import linear, moe
from moebus.cuda.kernels.prefetch import (copy_prefetch_cuda, plan_from_logits_cuda, plan_prefetch_cuda,
                                          remap_placement_cuda, remap_prefetched_cuda)

BANKS = 2
# H200, 16 x 32 A3B-shaped, 25% cache (docs/performance.md, tenth session): 2 slots over each token's
# top-2, with batch 8's misses on the GEMVs (expert_cache.MISSES_IN_GEMVS_UP_TO), 69.4 -> 70.8 tok/s at batch 1
# (within the runs' spread) and 530 -> 571 at batch 8 against no prefetch with tiles; 9% of the copies
# wasted. 4 slots over the top-4 wasted 15% and was slower (65.9, 518); 4 over the top-8 30% (sixth session)
DEFAULT_SLOTS_PER_LAYER = 2
# each token's surest predictions only: on an 8 x 32 A3B-shaped model (cpu, tools/device/
# prefetch6_precision.py) the predicted ranks 0-7 were right 0.97 0.95 0.91 0.82 0.74 0.68 0.54 0.51
# of the time; a wasted copy costs more than a prefetched expert saves (docs/expert-cache.md)
PREDICTED_PER_TOKEN = 2
# the side branch ranks the router's logits in the plan kernel itself (one launch less to wait for SMs
# beside the expert kernels: on the H200 topk_softmax took 116 us a call there and the plan 57, a few
# alone; tenth session). Not yet measured on a GPU, so off: MOEBUS_PREFETCH_PLAN_FROM_LOGITS=1
PLAN_FROM_LOGITS = os.environ.get("MOEBUS_PREFETCH_PLAN_FROM_LOGITS", "0") == "1"
# the next layer's copies wait for this layer's expert kernels (``after_experts``): those read this
# layer's misses over PCIe, and copies beside them only share the link with them, finishing with them,
# so the link idled through the next layer's attention and router all the same; queued after them,
# the copies fill that gap. Not yet measured on a GPU, so off: MOEBUS_PREFETCH_COPY_AFTER_EXPERTS=1
COPY_AFTER_EXPERTS = os.environ.get("MOEBUS_PREFETCH_COPY_AFTER_EXPERTS", "0") == "1"


class Prefetch:
    def __init__(self, slots_per_layer: int, num_rows: int, num_experts: int, per_token: int, blob_bytes: int):
        """``per_token``: the predicted experts of each token that may be copied (the model's top-k,
        or fewer: only each token's surest predictions, fewer wasted copies)."""
        self.slots_per_layer = slots_per_layer
        self.num_rows, self.num_experts, self.per_token = num_rows, num_experts, per_token
        self.blob_bytes = blob_bytes
        self.prefetched = self.used = 0  # experts, since start
        self._device = None  # (keys, side branch, {tokens: (logits, ids, weights)}) once on cuda
        self.open_row = None  # the layer row whose copies the side branch is making
        self._copy_args = None  # (keys, store, arena, first slot): copies waiting for after_experts
        self._experts_done = None  # the event the side branch waits on for them (cuda)

    @property
    def num_reserved(self) -> int:
        return BANKS * self.slots_per_layer

    def first_slot(self, row: int) -> int:
        return (row % BANKS) * self.slots_per_layer

    def stats(self) -> dict:
        wasted = self.prefetched - self.used
        return {"prefetch_slots": self.slots_per_layer, "prefetched": self.prefetched, "prefetch_used": self.used,
                "prefetch_wasted": wasted, "prefetch_bytes": self.prefetched * self.blob_bytes,
                "prefetch_wasted_bytes": wasted * self.blob_bytes}

    def observe(self, keys: np.ndarray, chosen: np.ndarray) -> int:
        """One step's bank keys (L, K) and choices (L, T, A): counts what was prefetched and used;
        returns the wasted experts (their PCIe bytes come on top of the misses read in place)."""
        rows = np.arange(chosen.shape[0], dtype=np.int64)[:, None, None]
        chosen_keys = np.unique((rows * self.num_experts + chosen).reshape(-1))
        fetched = keys[keys >= 0]
        used = int(np.isin(fetched, chosen_keys).sum())
        self.prefetched += len(fetched)
        self.used += used
        return len(fetched) - used

    # -- on the device (cuda) -----------------------------------------------------------------------

    def keys(self, ops):
        """The bank keys as the kernels write them; row 0 stays -1 (never prefetched)."""
        return self._on(ops)[0]

    def _on(self, ops):
        if self._device is None:
            from moebus.cuda.backends.graphs import SideBranch

            keys = ops.persist(np.full((self.num_rows, self.slots_per_layer), -1, np.int32))
            self._device = (keys, SideBranch(), {})
        return self._device

    def _buffers(self, ops, num_tokens: int):
        """Persistent per batch size: the side branch's buffers must outlive the layer that forks it
        (the step pool hands a layer's buffers to the next one), and a graph keeps their addresses."""
        buffers = self._on(ops)[2]
        if num_tokens not in buffers:
            buffers[num_tokens] = (ops.persist(np.zeros((num_tokens, self.num_experts), np.float32)),
                                   ops.persist(np.zeros((num_tokens, self.per_token), np.int32)),
                                   ops.persist(np.zeros((num_tokens, self.per_token), np.float32)))
        return buffers[num_tokens]

    def launch(self, ops, h, next_router, next_row: int, placement, store, arena) -> None:
        """After layer row next_row - 1's norm_route (``h``: its MLP input, kept alive by the caller
        until next_row's experts): predict next_row's experts and copy the missing ones, on the side."""
        keys, side, _ = self._on(ops)
        logits, ids, weights = self._buffers(ops, h.shape[0])
        side.fork(ops.stream)
        linear.linear_cuda(h, next_router, logits, stream=side.stream)
        if PLAN_FROM_LOGITS:
            plan_from_logits_cuda(logits, self.per_token, placement, next_row, keys[next_row], stream=side.stream)
        else:
            moe.topk_softmax_cuda(logits, self.per_token, False, ids, weights, stream=side.stream)
            plan_prefetch_cuda(ids, placement, next_row, keys[next_row], stream=side.stream)
        self.open_row = next_row
        if COPY_AFTER_EXPERTS:  # the copies once this layer's experts are done reading the link
            self._copy_args = (keys[next_row], store, arena, self.first_slot(next_row))
            return
        copy_prefetch_cuda(keys[next_row], store, arena, self.first_slot(next_row), stream=side.stream)

    def after_experts(self, ops) -> None:
        """Right after a layer's expert kernels are launched: the next layer's copies, if launch()
        left them for now (COPY_AFTER_EXPERTS), start on the side branch once those kernels are done."""
        if self._copy_args is None:
            return
        from moebus.cuda.backends.graphs import _record_and_wait
        from moebus.cuda.kernels.compat import SIMULATOR, cuda

        side = self._on(ops)[1]
        if not SIMULATOR:
            if self._experts_done is None:
                self._experts_done = cuda.event(timing=False)
            _record_and_wait(self._experts_done, ops.stream, side.stream)
        keys, store, arena, first_slot = self._copy_args
        self._copy_args = None
        copy_prefetch_cuda(keys, store, arena, first_slot, stream=side.stream)

    def around_experts(self, ops, row: int, pair_slot, h, next_router, placement, store, arena) -> tuple:
        """Between layer row ``row``'s norm_route and its experts: its prefetched experts in
        (``remap``), then row + 1's prefetch forked (``next_router`` None: the next layer is not
        the next MoE row). Returns what the caller keeps alive until row + 1's experts: (h,) or ()."""
        self.remap(ops, pair_slot, row)
        if next_router is None:
            return ()
        self.launch(ops, h, next_router, row + 1, placement, store, arena)
        return (h,)

    def around_tiles(self, ops, row: int, h, next_router, placement, store, arena) -> tuple:
        """around_experts for a layer whose experts run in tiles: returns (the placement row the
        tiles plan from, what the caller keeps alive until row + 1's experts)."""
        placement_row = self.remapped_row(ops, placement, row)
        if next_router is None:
            return placement_row, ()
        self.launch(ops, h, next_router, row + 1, placement, store, arena)
        return placement_row, (h,)

    def remapped_row(self, ops, placement, row: int):
        """Layer row ``row``'s placement, its prefetched experts at their bank slots (after their
        copies), or the table's own row where nothing was prefetched for it."""
        if self.open_row != row:
            return placement[row]
        self.after_experts(ops)  # copies still waiting (no expert kernel between): before the join
        keys, side, _ = self._on(ops)
        side.join(ops.stream)
        self.open_row = None
        out = ops.empty((placement.shape[1],), np.int32)
        return remap_placement_cuda(placement, row, keys[row], self.first_slot(row), out, stream=ops.stream)

    def remap(self, ops, pair_slot, row: int) -> None:
        """Before layer row ``row``'s experts: wait for its copies and point its pairs at them."""
        if self.open_row != row:
            return
        self.after_experts(ops)  # copies still waiting (no expert kernel between): before the join
        keys, side, _ = self._on(ops)
        side.join(ops.stream)
        self.open_row = None
        remap_prefetched_cuda(pair_slot, keys[row], self.first_slot(row), stream=ops.stream)

    def begin(self, ops) -> None:
        """Start of a step's run: no branch is open (a failed capture may have left one)."""
        self.open_row = None
        self._copy_args = None
        self._on(ops)[1].forks = 0
