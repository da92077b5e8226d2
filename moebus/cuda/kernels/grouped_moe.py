"""The experts of a long step (prefill) on tensor cores, in tiles. The step's (token, choice) pairs
are grouped by expert into tiles of ``t`` pairs (tile_pairs: 16 to 64): tile j holds ``parts`` x t rows,
part q of its i-th pair at row j parts t + q t + i (the split-bf16 activations, gemm.py: x = hi + lo),
so one product over a tile is x @ W^T for every part at once and the consumer sums the parts. An
expert with c pairs gets ceil(c / t) consecutive tiles; a layer's tiles are at most
``tile_bound(P, E)``, a bound the host knows without reading the routing.

Every tile is one problem of the same shape, so a layer's experts are one batched cuBLAS call per
projection (cublasGemmBatchedEx, pointer arrays on the device: each tile reads its expert's arena slot):

  gate|up (the blob's gate (I x D) and up (I x D) are one (2I, D) matrix) -> SwiGLU of the summed
  parts, split again -> down (D x I) -> each pair's row back in pair order, parts summed, for the
  combine that the next norm fuses (moe.combine_ref).

The plan (which row each pair has, which slot each tile reads) is made either on the device by one
kernel (``plan_on_device``: counts, a scan, ranks by atomics; no host round trip, the spare tiles up
to the bound compute on unused rows) or on the host from the routing (``plan_on_host``, when the
layer's experts are acquired in groups). Padding rows are computed and never read. Shapes: T tokens,
A active experts per token, P = T * A pairs, E experts, D hidden, I expert intermediate."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from moebus.cuda.kernels.compat import (bits_as_f32, blocks, cuda, f32_bits, float32, int32, int64, kernel, threads,
                                        uint16)
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.gemm import OP_N, OP_T, R_16BF, COMPUTE_32F, address

# the row kernels: a block per pair (or tile row), threads along it. A thread's loads of one element
# wait for its store of the one before (they may alias), so fewer elements a thread is fewer round
# trips: 128 -> 512 took gather / swiglu / sum 6.2 / 7.1 / 10.6 -> 3.4 / 4.8 / 4.7 us at batch 8 (decode11)
THREADS = 512
PLAN_THREADS = 1024  # the planner: one block...
PLAN_THREADS_FEW = 256  # ...of fewer threads for a step of at most this many pairs (decode: 9.6 -> 9.2 us at 64)
PAIRS_PER_TILE = int(os.environ.get("MOEBUS_EXPERT_TILE", "64"))  # the most; fewer for short steps (tile_pairs)
MIN_TILE_PAIRS = 16
MAX_EXPERTS = 512  # the device planner's counters (shared memory); more experts plan on the host
COUNTERS = MAX_EXPERTS + 1  # a constant: the shape of a shared array
# the six pointer rows of a plan: gate|up's A (weights), B (x rows), C (gate|up rows); down's A, B (h rows), C (y rows)
GATE_UP_ROWS, DOWN_ROWS = (0, 1, 2), (3, 4, 5)


def tile_pairs(num_pairs: int, num_experts: int, least: int = MIN_TILE_PAIRS) -> int:
    """Pairs per tile for a step: the mean pairs per expert, as a power of two in [least,
    PAIRS_PER_TILE], so that the padding (at most E t pairs) stays of the order of the pairs."""
    mean = max(1, -(-num_pairs // max(1, num_experts)))
    return int(min(PAIRS_PER_TILE, max(least, 1 << (mean - 1).bit_length())))


def tile_bound(num_pairs: int, num_experts: int, pairs_per_tile: int = PAIRS_PER_TILE) -> int:
    """The most tiles P pairs over E experts can need: sum of ceil(c_e / t) <= (P + E (t - 1)) / t."""
    return (num_pairs + num_experts * (pairs_per_tile - 1)) // pairs_per_tile


@dataclass
class TilePlan:
    """Host plan of a step's pairs: the active experts, ascending, and their tiles."""
    experts: np.ndarray  # (G,)
    first_tile: np.ndarray  # (G + 1,) tiles first_tile[g] ... first_tile[g + 1] - 1 are expert g's
    pair_row: np.ndarray  # (P,) int32: the row of pair p's part 0
    tile_fill: np.ndarray  # (num_tiles,) int32: the pairs of each tile (t but for an expert's last)
    num_tiles: int


def plan_tiles(ids: np.ndarray, parts: int, pairs_per_tile: int = PAIRS_PER_TILE) -> TilePlan:
    """ids (T, A) int32 on the host -> the plan, pairs of an expert in pair order (the reference of
    plan_on_device, whose order within an expert is the atomics')."""
    t = pairs_per_tile
    flat = np.asarray(ids, dtype=np.int32).reshape(-1)
    order = np.argsort(flat.astype(np.int16), kind="stable")  # a radix sort
    all_counts = np.bincount(flat)
    experts = np.flatnonzero(all_counts)
    counts = all_counts[experts]
    first_tile = np.concatenate([[0], np.cumsum(-(-counts // t))]).astype(np.int64)
    first_pair = np.cumsum(counts) - counts
    expert_of_sorted = np.repeat(np.arange(len(experts)), counts)
    rank = np.arange(len(flat)) - first_pair[expert_of_sorted]
    pair_row = np.empty(len(flat), np.int32)
    pair_row[order] = (first_tile[expert_of_sorted] + rank // t) * parts * t + rank % t
    tile_fill = np.bincount(first_tile[expert_of_sorted] + rank // t, minlength=first_tile[-1]).astype(np.int32)
    return TilePlan(experts, first_tile, pair_row, tile_fill, int(first_tile[-1]))


def tile_pointers(bases, strides, tiles: np.ndarray, tile_slots: np.ndarray) -> np.ndarray:
    """(6, n) int64 pointer rows for tiles ``tiles`` reading arena slots ``tile_slots``: weights at
    bases[c] + slot strides[c] (c = 0, 3), rows at bases[c] + tile strides[c] (the rest)."""
    tiles, tile_slots = np.asarray(tiles, np.int64), np.asarray(tile_slots, np.int64)
    return np.stack([base + (tile_slots if c in (0, 3) else tiles) * stride
                     for c, (base, stride) in enumerate(zip(bases, strides))]).astype(np.int64)


def grouped_ffn_ref(x: np.ndarray, ids: np.ndarray, experts_gate_up: dict, experts_down: dict) -> np.ndarray:
    # x (T, D) float32, ids (T, A); experts_*: expert -> (2I, D) / (D, I) float32 -> (P, D) in pair order
    from moebus.cuda.kernels.elementwise import swiglu_ref

    out = np.zeros((ids.size, x.shape[1]), np.float32)
    for p, e in enumerate(np.asarray(ids).reshape(-1)):
        gu = x[p // ids.shape[1]] @ experts_gate_up[e].T
        inter = gu.shape[0] // 2
        out[p] = swiglu_ref(gu[:inter], gu[inter:]) @ experts_down[e].T
    return out


# -- cuda -----------------------------------------------------------------------------------------

@kernel
def plan_tiles_device(ids, num_experts, pairs_per_tile, parts, slots, bases, strides, store_bases, pair_row, pointers,
                      tile_fill):
    # one block: counts per expert, tile starts (a scan), each pair's rank by atomics, then each
    # tile's pointers (tile_pointers) and pairs. slots[e] is an arena slot, or (negative, a
    # placement-table entry) row -1 - slots[e] of the host store at store_bases; tiles past the last
    # real one read the first expert with a slot (VRAM; the last real tile's where none has one)
    # into rows of their own, with no pairs
    grid_dependency_wait()  # pdl.py: before any global read or write
    counts = cuda.shared.array(COUNTERS, int32)
    starts = cuda.shared.array(COUNTERS, int32)
    tid, step = cuda.threadIdx.x, cuda.blockDim.x
    num_tokens, top_k = ids.shape
    t = pairs_per_tile
    for e in range(tid, num_experts + 1, step):
        counts[e] = 0
    cuda.syncthreads()
    for p in range(tid, num_tokens * top_k, step):
        cuda.atomic.add(counts, ids[p // top_k, p % top_k], 1)
    cuda.syncthreads()
    if tid == 0:
        total = 0
        spare = -1
        for e in range(num_experts):
            starts[e] = total
            total += (counts[e] + t - 1) // t
            counts[e] = 0  # from here on: pairs placed so far
            if spare < 0 and slots[e] >= 0:
                spare = e
        starts[num_experts] = total
        counts[num_experts] = spare  # the spare tiles' expert (-1: none with a slot)
    cuda.syncthreads()
    for p in range(tid, num_tokens * top_k, step):
        e = ids[p // top_k, p % top_k]
        rank = cuda.atomic.add(counts, e, 1)
        pair_row[p] = (starts[e] + rank // t) * parts * t + rank % t
    cuda.syncthreads()  # counts are whole again
    num_real = starts[num_experts]
    for j in range(tid, pointers.shape[1], step):
        tile_fill[j] = 0
        e = counts[num_experts]
        if j < num_real or e < 0:  # the last expert whose tiles start at or before j (or before the end)
            target = min(j, num_real - 1)
            lo, hi = 0, num_experts - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if starts[mid] <= target:
                    lo = mid
                else:
                    hi = mid - 1
            e = lo
            if j < num_real:
                tile_fill[j] = min(t, counts[e] - (j - starts[e]) * t)
        entry = slots[e]
        for c in range(6):
            if c != 0 and c != 3:
                pointers[c, j] = bases[c] + int64(j) * strides[c]
            elif entry >= 0:
                pointers[c, j] = bases[c] + int64(entry) * strides[c]
            else:
                pointers[c, j] = store_bases[c] + int64(-1 - entry) * strides[c]


@kernel
def gather_split_pairs(x, pair_row, top_k, parts, pairs_per_tile, out):
    # part q of x[p // top_k] -> out[pair_row[p] + q t]; out (R, D) uint16; a block per pair
    grid_dependency_wait()  # pdl.py: before any global read or write
    for p in range(cuda.blockIdx.x, pair_row.shape[0], cuda.gridDim.x):
        token, row = p // top_k, pair_row[p]
        for d in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            rest = x[token, d]
            for q in range(parts):
                bits = f32_bits(rest)
                rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest even (gemm.split_rows)
                out[row + q * pairs_per_tile, d] = uint16(rounded)
                rest = float32(rest - bits_as_f32(rounded << 16))


@kernel
def swiglu_split_tiles(gate_up, tile_fill, first_tile, num_tiles, parts, pairs_per_tile, out):
    # the pair rows of tiles first_tile ...: silu(gate) * up of the summed parts of gate_up (R, 2I),
    # split again into out (R, I); a block per row slot, padding skipped (its rows are never read)
    grid_dependency_wait()  # pdl.py: before any global read or write
    inter, t = out.shape[1], pairs_per_tile
    for s in range(cuda.blockIdx.x, num_tiles * t, cuda.gridDim.x):
        tile = first_tile + s // t
        if s % t >= tile_fill[tile]:
            continue
        row = tile * parts * t + s % t
        for d in range(cuda.threadIdx.x, inter, cuda.blockDim.x):
            g, u = float32(0.0), float32(0.0)
            for q in range(parts):
                g += gate_up[row + q * t, d]
                u += gate_up[row + q * t, inter + d]
            rest = float32(g / (float32(1.0) + math.exp(-g)) * u)
            for q in range(parts):
                bits = f32_bits(rest)
                rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                out[row + q * t, d] = uint16(rounded)
                rest = float32(rest - bits_as_f32(rounded << 16))


@kernel
def sum_parts_pairs(y, pair_row, parts, pairs_per_tile, out):
    # out[p] = sum over parts q of y[pair_row[p] + q t]
    grid_dependency_wait()  # pdl.py: before any global read or write
    num_pairs, dim = out.shape
    for p in range(cuda.blockIdx.x, num_pairs, cuda.gridDim.x):
        row = pair_row[p]
        for d in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
            total = float32(0.0)
            for q in range(parts):
                total += y[row + q * pairs_per_tile, d]
            out[p, d] = total


def _launch(kern, num_rows: int, stream, *args):
    if num_rows:
        kern[blocks(num_rows), threads(THREADS), stream](*args)


class ExpertTiles:
    """One MoE layer of a long step over ``max_tiles`` tiles: the rows, the pairs gathered into them;
    then ``gate_up``, ``swiglu`` and ``down`` over tiles (pointer tables from a plan), and
    ``pair_outputs`` (P, D) in pair order."""

    def __init__(self, ops, tensor_cores, h, top_k: int, max_tiles: int, hidden: int, inter: int,
                 pairs_per_tile: int = PAIRS_PER_TILE):
        self.ops, self.tc, self.top_k, self.hidden, self.inter = ops, tensor_cores, top_k, hidden, inter
        self.h, self.t, self.max_tiles = h, pairs_per_tile, max_tiles
        tile_rows = tensor_cores.parts * pairs_per_tile
        num_rows = max_tiles * tile_rows
        self.x_rows = ops.empty((num_rows, hidden), np.uint16)
        self.gate_up_rows = ops.empty((num_rows, 2 * inter))
        self.h_rows = ops.empty((num_rows, inter), np.uint16)
        self.y_rows = ops.empty((num_rows, hidden))
        self.pair_row = ops.empty((h.shape[0] * top_k,), np.int32)
        self.tile_fill = ops.empty((max_tiles,), np.int32)
        self.strides = tuple(tile_rows * n for n in (hidden * 2, 2 * inter * 4, inter * 2, hidden * 4))

    def pointer_layout(self, arena) -> tuple[tuple, tuple]:
        """(bases, strides) of tile_pointers / plan_tiles_device for this layer's rows and ``arena``."""
        slot_bytes = arena.shape[1] * arena.dtype.itemsize
        down_at = 2 * self.inter * self.hidden * arena.dtype.itemsize
        bases = (address(arena), address(self.x_rows), address(self.gate_up_rows), address(arena) + down_at,
                 address(self.h_rows), address(self.y_rows))
        x, gate_up, h, y = self.strides
        return bases, (slot_bytes, x, gate_up, slot_bytes, h, y)

    def plan_on_device(self, ids, arena, slots, num_experts: int, store=None):
        """The plan made by one kernel from the router's ``ids`` (T, A) on the device and each
        expert's place ``slots`` (E,) int32: an arena slot, or (decode's placement table, routing.py)
        ``-1 - row`` of ``store`` (the host store as the device sees it, mapped; rows as the
        arena's); returns the (6, max_tiles) pointer table."""
        if num_experts > MAX_EXPERTS:
            raise ValueError(f"{num_experts} experts: the device plan counts at most {MAX_EXPERTS}")
        pointers = self.ops.empty((6, self.max_tiles), np.int64)
        bases, strides = self.pointer_layout(arena)
        store_bases = bases if store is None else self.pointer_layout(store)[0]
        num_pairs = ids.shape[0] * ids.shape[1]
        plan_threads = PLAN_THREADS_FEW if num_pairs <= PLAN_THREADS_FEW else PLAN_THREADS
        plan_tiles_device[1, threads(plan_threads), self.ops.stream](
            ids, int(num_experts), int(self.t), int(self.tc.parts), slots, bases, strides, store_bases, self.pair_row,
            pointers, self.tile_fill)
        self.gather()
        return pointers

    def plan_on_host(self, plan: TilePlan) -> None:
        self.pair_row, self.tile_fill = self.ops.upload(plan.pair_row), self.ops.upload(plan.tile_fill)
        self.gather()

    def gather(self) -> None:
        _launch(gather_split_pairs, self.pair_row.shape[0], self.ops.stream, self.h, self.pair_row, self.top_k,
                self.tc.parts, self.t, self.x_rows)

    def gate_up(self, pointers, first: int = 0, count: int | None = None) -> None:
        """gate|up products of the tiles in columns first ... of ``pointers`` (a (6, n) device table)."""
        self._products(pointers, GATE_UP_ROWS, first, count, self.hidden, 2 * self.inter)

    def swiglu(self, first_tile: int, num_tiles: int) -> None:
        _launch(swiglu_split_tiles, num_tiles * self.t, self.ops.stream, self.gate_up_rows, self.tile_fill,
                int(first_tile), int(num_tiles), self.tc.parts, self.t, self.h_rows)

    def down(self, pointers, first: int = 0, count: int | None = None) -> None:
        self._products(pointers, DOWN_ROWS, first, count, self.inter, self.hidden)

    def _products(self, pointers, rows: tuple, first: int, count: int | None, dim_in: int, dim_out: int) -> None:
        """C = A^T B for each tile: out rows (dim_out wide) = rows (dim_in wide) @ W^T, W (dim_out, dim_in)."""
        width = pointers.shape[1]
        count = width - first if count is None else count
        if not count:
            return
        a, b, c = (address(pointers) + (r * width + first) * 8 for r in rows)
        self.tc.blas.gemm_batched(self.ops.stream, OP_T, OP_N, dim_out, self.tc.parts * self.t, dim_in, a, R_16BF,
                                  dim_in, b, R_16BF, dim_in, c, dim_out, compute=COMPUTE_32F, batch=count)

    def pair_outputs(self, pair_row=None):
        """(P, D) float32: row p is pair p's expert output (moe.combine's y_pair); with ``pair_row``
        (a device subset of the plan's, some pairs' rows), those pairs' outputs in its order."""
        pair_row = self.pair_row if pair_row is None else pair_row
        out = self.ops.empty((pair_row.shape[0], self.hidden))
        _launch(sum_parts_pairs, out.shape[0], self.ops.stream, self.y_rows, pair_row, self.tc.parts, self.t, out)
        return out
