"""The experts of a long step (prefill) on tensor cores, in tiles of pairs grouped by expert
(cuda/kernels/grouped_moe.py).

Where the cache can hold a whole layer and the step has pairs enough that nearly every expert is
chosen anyway (``DEVICE_PLAN_PAIRS_PER_EXPERT``), the layer's experts are acquired all at once and
the plan is made on the device from the router's choices: no host round trip, one batched product
per projection (``plan="device"``). Otherwise the routing comes to the host once for the layer, and
each group of experts that fits the cache is acquired, computed from its arena slots, then released
to the next; resident experts' gate|up products run while the misses are still being copied in
(``plan="host"``). Either way a prefill chunk's missed experts are copied in once and serve all of
the chunk's tokens.

Used where the backend has tensor cores and the experts are bf16; otherwise Stage._moe (GEMVs).

Decode steps of several sequences (``groups_in_decode``: at least ``DECODE_PAIRS_PER_EXPERT`` pairs
per expert, e.g. batch 8 over 32 experts of 8 chosen: 2; batch 64: 16) take the same tiles from the router's
choices on the device, each expert read where decode's placement table says (an arena slot, or the
host store through its mapping), so the step stays one captured graph (``grouped_moe_placed``);
smaller batches keep the GEMVs, which read each expert once per run of <= 8 pairs but do their
arithmetic on CUDA cores (at batch 8 each word of an expert serves ~2.4 tokens)."""
from __future__ import annotations

import os

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import COMPUTE_32F, OP_N, OP_T, R_16BF, address
from moebus.cuda.kernels.grouped_moe import (MAX_EXPERTS, MIN_TILE_PAIRS, PAIRS_PER_TILE, ExpertTiles, plan_tiles,
                                             tile_bound, tile_pairs, tile_pointers)

DEVICE_PLAN_PAIRS_PER_EXPERT = 4  # with P >= 4 E uniform routing leaves < 2% of the experts unchosen
PLAN = os.environ.get("MOEBUS_EXPERT_PLAN", "auto")  # auto, device or host (for comparison)
# decode: tiles instead of the GEMVs from this many pairs per expert (0: never): batch 8 over 32
# experts of 8 chosen has 2; H200, 48 x 32: batch 8 9.26 -> 8.73 ms a step, 16: 15.53 -> 10.60 (tc8)
DECODE_PAIRS_PER_EXPERT = int(os.environ.get("MOEBUS_DECODE_GROUPED_PAIRS_PER_EXPERT", "2"))
# decode's tiles: at least this many pairs (2 x as many rows, the split parts: the products' n), so
# that a step of 8 sequences (~2 pairs per chosen expert) reads most experts in one tile of 16 rows
DECODE_MIN_TILE_PAIRS = int(os.environ.get("MOEBUS_DECODE_MIN_TILE_PAIRS", "8"))
# warm_products: a worker's start runs the host-planned groups' products for 1 ... this many tiles at
# each tile width (0: none). cuBLAS picks its kernel by the batch count too, and loads each kernel at
# its first launch (CUDA's lazy loading, ~4.5 ms of host time each on the H200): the first image's
# spanning chunk beside text streams met ~30 of them (eleventh session's trace)
WARM_PRODUCT_TILES = int(os.environ.get("MOEBUS_WARM_PRODUCT_TILES", "256"))
# warm_dense: a worker's start runs each dense weight's product (attention's projections, the router)
# at every row count from the tensor cores' least up to this many (0, the default until a GPU call
# measures it: none). cuBLAS picks its kernel
# by n (the rows) too: thirteenth session's call 1, a 510-token chunk's first step loaded o_proj's two
# (beta 0 and 1) at n 510 (4.6 ms of host time, in a 20.5 ms step; at n 244 qkv's and o's, 12.7 ms)
WARM_DENSE_ROWS = int(os.environ.get("MOEBUS_WARM_DENSE_ROWS", "1024"))  # (1.45 s at a start on the H200; 0 off)


def can_group_on_device(ops, experts, num_tokens: int) -> bool:
    tensor_cores = getattr(ops, "tensor_cores", None)
    return tensor_cores is not None and num_tokens >= tensor_cores.min_rows and experts.array.dtype == np.uint16


def groups_in_decode(ops, experts, num_pairs: int, num_experts: int) -> bool:
    """True where a decode step's experts run in tiles on tensor cores (grouped_moe_placed)."""
    tensor_cores = getattr(ops, "tensor_cores", None)
    return (tensor_cores is not None and DECODE_PAIRS_PER_EXPERT > 0 and experts.array.dtype == np.uint16
            and experts.store.layout is None and num_experts <= MAX_EXPERTS
            and num_pairs >= DECODE_PAIRS_PER_EXPERT * num_experts)


def plans_on_device(experts, num_pairs: int, num_experts: int) -> bool:
    """True where the whole layer is acquired and planned on the device (see the module doc)."""
    if PLAN != "auto":
        return PLAN == "device" and num_experts <= min(MAX_EXPERTS, experts.num_slots)
    whole_layer = num_experts <= min(MAX_EXPERTS, experts.num_slots)
    return whole_layer and num_pairs >= DEVICE_PLAN_PAIRS_PER_EXPERT * num_experts


def grouped_moe(ops, experts, layer: int, h, ids, hidden: int, inter: int, num_experts: int):
    """(P, D) float32 expert outputs in pair order for ``h`` (T, D) and the router's ids (T, A) on
    the device."""
    num_tokens, top_k = ids.shape
    try:
        if plans_on_device(experts, num_tokens * top_k, num_experts):
            return _planned_on_device(ops, experts, layer, h, ids, hidden, inter, num_experts)
        return _planned_on_host(ops, experts, layer, h, ops.to_host(ids), hidden, inter)
    finally:
        experts.release()


def _planned_on_device(ops, experts, layer: int, h, ids, hidden: int, inter: int, num_experts: int):
    slots, ready = experts.acquire(layer, np.arange(num_experts))
    t = tile_pairs(ids.size, num_experts)
    work = ExpertTiles(ops, ops.tensor_cores, h, ids.shape[1], tile_bound(ids.size, num_experts, t), hidden, inter, t)
    pointers = work.plan_on_device(ids, experts.array, ops.upload(slots), num_experts)
    if not ready.all():
        experts.wait()  # the compute stream waits for the copies (no host sync)
    work.gate_up(pointers)
    work.swiglu(0, work.max_tiles)
    work.down(pointers)
    return work.pair_outputs()


def _planned_on_host(ops, experts, layer: int, h, ids_host: np.ndarray, hidden: int, inter: int):
    tiles = HostTiles(ops, experts, h, ids_host, hidden, inter)
    group = max(1, experts.num_slots)  # a cache smaller than the layer's active experts: in groups
    for first in range(0, len(tiles.plan.experts), group):
        tiles.run_group(layer, first, min(first + group, len(tiles.plan.experts)))
    return tiles.work.pair_outputs()


class HostTiles:
    """A layer of a long step planned on the host (``plan_tiles``) and its pairs gathered into tiles,
    whose experts are then computed group by group, each group acquired from the cache: by
    ``_planned_on_host`` (a cache that cannot hold the layer's experts at once) and by a prompt chunk
    that spans steps (chunk_advance.py: a step runs the groups whose copies fit its budget, and
    writes their pairs' outputs with ``write_pairs``). Group g is the plan's experts[g] (ascending:
    the same order as ``np.unique`` of the ids), its tiles first_tile[g] ... first_tile[g + 1] - 1."""

    def __init__(self, ops, experts, h, ids_host: np.ndarray, hidden: int, inter: int, made=None):
        """``made``: the ``made`` of an earlier HostTiles of the same ids (a chunk's layer continued in
        a later step), whose host plan is taken as it is (its tiles are gathered again)."""
        self.ops, self.experts = ops, experts
        if made is None:
            t = tile_pairs(ids_host.size, len(np.unique(ids_host)))
            made = (t, plan_tiles(ids_host, ops.tensor_cores.parts, t))
        self.made = made
        t, self.plan = made
        plan = self.plan
        self.work = ExpertTiles(ops, ops.tensor_cores, h, ids_host.shape[1], max(plan.num_tiles, 1), hidden, inter, t)
        self.work.plan_on_host(plan)
        self.bases, self.strides = self.work.pointer_layout(experts.array)
        self.tiles_of = np.diff(plan.first_tile)

    def run_group(self, layer: int, first: int, end: int, parts=None) -> None:
        """The experts plan.experts[first:end], acquired: the resident ones' gate|up products run
        while the misses are still being copied in, then the rest, SwiGLU and down. ``parts``: a
        step_parts.StepParts told when the acquire (it waits for the admissions in flight) and the
        kernels start."""
        plan, work, experts = self.plan, self.work, self.experts
        if parts is not None:
            parts.begin("acquire (sync)")
        slots, ready = experts.acquire(layer, plan.experts[first:end])
        if parts is not None:
            parts.begin("group kernels")
        tiles = np.arange(plan.first_tile[first], plan.first_tile[end])
        tiles_of = self.tiles_of[first:end]
        tile_slots, tile_ready = np.repeat(slots, tiles_of), np.repeat(ready, tiles_of)
        order = np.argsort(~tile_ready, kind="stable")  # ready tiles first
        pointers = self.ops.upload(tile_pointers(self.bases, self.strides, tiles[order], tile_slots[order]))
        num_ready = int(tile_ready.sum())
        work.gate_up(pointers, 0, num_ready)
        if num_ready < len(tiles):
            experts.wait()
            work.gate_up(pointers, num_ready)
        work.swiglu(tiles[0], len(tiles))
        work.down(pointers)

    def write_pairs(self, out, pairs: np.ndarray) -> None:
        """The outputs of ``pairs`` (indices in pair order, their groups run) into those rows of
        ``out`` (P, D) float32 on the device; the other rows are left as they are."""
        if not len(pairs):
            return
        rows = self.ops.upload(np.asarray(pairs, np.int32))
        values = self.work.pair_outputs(self.ops.upload(self.plan.pair_row[pairs]))
        self.ops.scatter_rows(out, rows, values)


def warm_products(ops, hidden: int, inter: int, max_tiles: int | None = None) -> int:
    """Run ExpertTiles' two products (gate|up, down) once for each batch count 1 ... ``max_tiles`` at
    each tile width ``tile_pairs`` can give (powers of two in [MIN_TILE_PAIRS, PAIRS_PER_TILE]), every
    tile reading and writing the same scratch rows (their values are not used), so that every cuBLAS
    kernel a spanning chunk's groups can pick is loaded before the first image. Returns the products
    run; the buffers are the caller's step scratch (``ops.begin_step`` gives them back)."""
    if max_tiles is None:  # the simulator's HostBlas loads no kernels (its test asks for a few tiles)
        max_tiles = 0 if SIMULATOR else WARM_PRODUCT_TILES
    tc = getattr(ops, "tensor_cores", None)
    if tc is None or max_tiles <= 0:
        return 0
    widths, t = [], MIN_TILE_PAIRS
    while t <= PAIRS_PER_TILE:
        widths.append(t)
        t *= 2
    rows = tc.parts * widths[-1]
    weight = ops.zeros((2 * inter, hidden), np.uint16)  # gate|up (2I, D); down reads its first D x I
    x_rows, h_rows = ops.zeros((rows, hidden), np.uint16), ops.zeros((rows, inter), np.uint16)
    out_rows = ops.empty((rows, max(2 * inter, hidden)))
    table = ops.upload(np.repeat(np.array([[address(weight)], [address(x_rows)], [address(out_rows)],
                                           [address(weight)], [address(h_rows)], [address(out_rows)]], np.int64),
                                 max_tiles, axis=1))
    done = 0
    for t in widths:
        for count in range(1, max_tiles + 1):
            for (a, b, c), dim_in, dim_out in (((0, 1, 2), hidden, 2 * inter), ((3, 4, 5), inter, hidden)):
                pa, pb, pc = (address(table) + r * max_tiles * 8 for r in (a, b, c))
                tc.blas.gemm_batched(ops.stream, OP_T, OP_N, dim_out, tc.parts * t, dim_in, pa, R_16BF, dim_in, pb,
                                     R_16BF, dim_in, pc, dim_out, compute=COMPUTE_32F, batch=count)
                done += 1
    ops.synchronize()
    return done


def warm_dense(ops, weights, least_rows: int, max_rows: int | None = None) -> int:
    """Run ``TensorCores.matmul_nt`` (each split part's product: the first with beta 0, the next with
    beta 1) for each distinct shape of ``weights`` (device bf16 matrices (N, K): a layer's dense
    weights) at every row count ``least_rows`` ... ``max_rows`` (the rows of a chunk's step), on
    scratch rows whose values are not used, so that the kernels cuBLAS picks for a chunk's dense
    products are loaded before the first image. Returns the products run (cuBLAS calls); the buffers
    are the caller's step scratch."""
    if max_rows is None:
        max_rows = 0 if SIMULATOR else WARM_DENSE_ROWS
    tc = getattr(ops, "tensor_cores", None)
    least_rows = max(least_rows, 1 if tc is None else tc.min_rows)
    if tc is None or max_rows < least_rows:
        return 0
    shapes = {}
    for weight in weights:
        if getattr(weight, "dtype", None) == np.uint16 and len(weight.shape) == 2:
            shapes.setdefault(tuple(weight.shape), weight)
    done = 0
    for (num_out, dim_in), weight in sorted(shapes.items()):
        parts = ops.zeros((tc.parts, max_rows, dim_in), np.uint16)
        out = ops.empty((max_rows, num_out))
        for rows in range(least_rows, max_rows + 1):
            tc.matmul_nt(ops, parts, 0, rows, address(weight), num_out, out)
            done += tc.parts
    ops.synchronize()
    return done


def grouped_moe_placed(ops, experts, h, ids, placement_row, hidden: int, inter: int, num_experts: int):
    """(P, D) float32 expert outputs in pair order for a decode step: ``h`` (T, D) and the router's
    ``ids`` (T, A) on the device, each expert where ``placement_row`` (E,) (the placement table's row
    of this layer) says. Kernels and cuBLAS calls only (capturable); tiles of about twice the mean
    pairs per expert, so that most experts take one tile and are read once."""
    num_pairs = ids.size
    t = tile_pairs(2 * num_pairs, num_experts, least=DECODE_MIN_TILE_PAIRS)
    work = ExpertTiles(ops, ops.tensor_cores, h, ids.shape[1], tile_bound(num_pairs, num_experts, t), hidden, inter, t)
    pointers = work.plan_on_device(ids, experts.array, placement_row, num_experts, store=experts.store.device_blobs)
    work.gate_up(pointers)
    work.swiglu(0, work.max_tiles)
    work.down(pointers)
    return work.pair_outputs()
