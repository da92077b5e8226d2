"""The experts of a long step (prefill) on tensor cores, grouped by expert. The step's (token, choice)
pairs are sorted by expert; each active expert gets a block of rows, ``parts`` x ``cap`` (cap: its
pair count rounded up to ROW_ALIGN), holding its tokens' split-bf16 activations, part after part
(gemm.py: x = hi + lo). One product over such a block is x @ W^T for every part at once; the
consumer sums the parts. Experts whose blocks have the same cap go in one batched cuBLAS call
(pointer arrays: each reads its own arena slot), so a layer costs a few calls, not one per expert:

  gate|up (the blob's gate (I x D) and up (I x D) are one (2I, D) matrix) -> SwiGLU of the summed
  parts, split again -> down (D x I) -> each pair's row back in pair order, parts summed, for the
  combine that the next norm fuses (moe.combine_ref).

Padding rows are computed and never read. Shapes: T tokens, A active experts per token, P = T * A
pairs, G active experts, D hidden, I expert intermediate, R rows of the blocks."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from moebus.cuda.kernels.compat import bits_as_f32, blocks, cuda, f32_bits, float32, kernel, threads, uint16
from moebus.cuda.kernels.gemm import OP_N, OP_T, R_16BF, COMPUTE_32F, address

THREADS = 128  # a block per pair, threads along its row
ROW_ALIGN = 32  # an expert's rows are padded to this: fewer distinct caps, fewer calls
BATCHED = os.environ.get("MOEBUS_EXPERT_CALLS", "batched") == "batched"


@dataclass
class PairPlan:
    """The step's pairs p = t * A + k sorted by expert (stable) and laid out in blocks."""
    experts: np.ndarray  # (G,) the active experts, ascending
    counts: np.ndarray  # (G,) pairs of each
    caps: np.ndarray  # (G,) counts rounded up to ROW_ALIGN
    bases: np.ndarray  # (G,) first row of each expert's block (blocks of parts x cap rows)
    first_pair: np.ndarray  # (G,) first sorted pair of each
    sorted_token: np.ndarray  # (P,) int32: the token of each sorted pair
    sorted_row: np.ndarray  # (P,) int32: its row in part 0 of its block
    sorted_cap: np.ndarray  # (P,) int32: its block's cap (part q is cap * q rows further)
    pair_row: np.ndarray  # (P,) int32: sorted_row of pair p
    pair_cap: np.ndarray  # (P,) int32
    num_rows: int  # R


def plan_pairs(ids: np.ndarray, parts: int) -> PairPlan:
    # ids (T, A) int32 on the host; a radix sort (int16 keys) and counts: O(P) host work a layer
    flat = np.asarray(ids, dtype=np.int32).reshape(-1)
    order = np.argsort(flat.astype(np.int16), kind="stable")
    all_counts = np.bincount(flat)
    experts = np.flatnonzero(all_counts)
    counts = all_counts[experts]
    first_pair = np.cumsum(counts) - counts
    caps = block_rows(counts)
    bases = np.concatenate([[0], np.cumsum(parts * caps)[:-1]]).astype(np.int64)
    expert_of_sorted = np.repeat(np.arange(len(experts)), counts)
    sorted_row = (bases[expert_of_sorted] + np.arange(len(flat)) - first_pair[expert_of_sorted]).astype(np.int32)
    sorted_cap = caps[expert_of_sorted].astype(np.int32)
    where = np.empty_like(order)
    where[order] = np.arange(len(order))
    return PairPlan(experts, counts, caps, bases, first_pair, (order // ids.shape[1]).astype(np.int32), sorted_row,
                    sorted_cap, sorted_row[where], sorted_cap[where], int(parts * caps.sum()))


def block_rows(counts: np.ndarray) -> np.ndarray:
    """Rows of each expert's block part: its count rounded up to ROW_ALIGN, and above 4 ROW_ALIGN to
    a quarter of its power of two, so that a layer's blocks come in few sizes (one call each) and
    padding stays under 25%."""
    counts = np.asarray(counts, np.int64)
    step = np.maximum(ROW_ALIGN, (1 << np.floor(np.log2(np.maximum(counts, 1))).astype(np.int64)) // 4)
    return -(-counts // step) * step


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

# ``table`` (5, P) int32: sorted_token, sorted_row, sorted_cap, pair_row, pair_cap (PairPlan)

@kernel
def gather_split_rows(x, table, parts, out):
    # out[sorted_row[j] + q * sorted_cap[j]] = part q of x[sorted_token[j]]; out (R, D) uint16
    # a block per pair (grid-stride), threads along the row, as every kernel here
    for j in range(cuda.blockIdx.x, table.shape[1], cuda.gridDim.x):
        token, row, cap = table[0, j], table[1, j], table[2, j]
        for d in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            rest = x[token, d]
            for q in range(parts):
                bits = f32_bits(rest)
                rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest even (gemm.split_rows)
                out[row + q * cap, d] = uint16(rounded)
                rest = float32(rest - bits_as_f32(rounded << 16))


@kernel
def swiglu_split_rows(gate_up, table, first_pair, num_pairs, parts, out):
    # the pairs first_pair ...: silu(gate) * up of the summed parts of gate_up (R, 2I), split again into out (R, I)
    inter = out.shape[1]
    for j in range(first_pair + cuda.blockIdx.x, first_pair + num_pairs, cuda.gridDim.x):
        row, cap = table[1, j], table[2, j]
        for d in range(cuda.threadIdx.x, inter, cuda.blockDim.x):
            g, u = float32(0.0), float32(0.0)
            for q in range(parts):
                g += gate_up[row + q * cap, d]
                u += gate_up[row + q * cap, inter + d]
            rest = float32(g / (float32(1.0) + math.exp(-g)) * u)
            for q in range(parts):
                bits = f32_bits(rest)
                rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                out[row + q * cap, d] = uint16(rounded)
                rest = float32(rest - bits_as_f32(rounded << 16))


@kernel
def sum_parts_rows(y, table, parts, out):
    # out[p] = sum over parts q of y[pair_row[p] + q * pair_cap[p]]
    num_pairs, dim = out.shape
    for p in range(cuda.blockIdx.x, num_pairs, cuda.gridDim.x):
        row, cap = table[3, p], table[4, p]
        for d in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
            total = float32(0.0)
            for q in range(parts):
                total += y[row + q * cap, d]
            out[p, d] = total


def _launch(kern, num_rows: int, stream, *args):
    if num_rows:
        kern[blocks(num_rows), threads(THREADS), stream](*args)


class GroupedExperts:
    """One MoE layer of a long step: ``gate_up`` and ``down`` per group of experts resident in the
    arena (the caller acquires their slots; ``picked`` indexes the plan's experts), then
    ``pair_outputs`` (P, D) in pair order."""

    def __init__(self, ops, tensor_cores, h, plan: PairPlan, hidden: int, inter: int):
        self.ops, self.tc, self.plan, self.hidden, self.inter = ops, tensor_cores, plan, hidden, inter
        parts = tensor_cores.parts
        self.table = ops.upload(np.stack([plan.sorted_token, plan.sorted_row, plan.sorted_cap, plan.pair_row,
                                          plan.pair_cap]))
        self.x_rows = ops.empty((plan.num_rows, hidden), np.uint16)
        _launch(gather_split_rows, len(plan.sorted_token), ops.stream, h, self.table, parts, self.x_rows)
        self.gate_up_rows = ops.empty((plan.num_rows, 2 * inter))
        self.h_rows = ops.empty((plan.num_rows, inter), np.uint16)
        self.y_rows = ops.empty((plan.num_rows, hidden))

    def gate_up(self, arena, slots, picked) -> None:
        self._products(arena, slots, picked, 0, self.x_rows, self.hidden, self.gate_up_rows, 2 * self.inter)

    def down(self, arena, slots, picked) -> None:
        """SwiGLU over the group's pairs (consecutive: its experts are), then the down products."""
        plan = self.plan
        first = int(plan.first_pair[picked].min())
        end = int((plan.first_pair[picked] + plan.counts[picked]).max())
        _launch(swiglu_split_rows, end - first, self.ops.stream, self.gate_up_rows, self.table, first,
                end - first, self.tc.parts, self.h_rows)
        down_at = 2 * self.inter * self.hidden * arena.dtype.itemsize
        self._products(arena, slots, picked, down_at, self.h_rows, self.inter, self.y_rows, self.hidden)

    def _products(self, arena, slots, picked, offset: int, rows, dim_in: int, out, dim_out: int) -> None:
        """out block of each picked expert = its rows block @ W^T, W (dim_out, dim_in) at ``offset``
        bytes into its slot; one batched call per distinct cap."""
        if not len(picked):
            return
        plan, parts = self.plan, self.tc.parts
        slot_bytes = arena.shape[1] * arena.dtype.itemsize
        caps = plan.caps[picked]
        order = np.argsort(caps, kind="stable")
        pointers = np.stack([address(arena) + np.asarray(slots, np.int64)[order] * slot_bytes + offset,
                             address(rows) + plan.bases[picked][order] * dim_in * 2,
                             address(out) + plan.bases[picked][order] * dim_out * 4]).astype(np.int64)
        if not BATCHED:  # one call per expert (MOEBUS_EXPERT_CALLS=each), for comparison
            for a, b, c, cap in zip(*pointers.tolist(), caps[order].tolist()):
                self.tc.blas.gemm(self.ops.stream, OP_T, OP_N, dim_out, parts * cap, dim_in, a, R_16BF, dim_in, b,
                                  R_16BF, dim_in, c, dim_out, compute=COMPUTE_32F)
            return
        table = self.ops.upload(pointers)
        at, step = address(table), len(picked) * 8
        for cap, first, num in zip(*(r.tolist() for r in _runs(caps[order]))):
            self.tc.blas.gemm_batched(self.ops.stream, OP_T, OP_N, dim_out, parts * cap, dim_in,
                                      at + first * 8, R_16BF, dim_in, at + step + first * 8, R_16BF, dim_in,
                                      at + 2 * step + first * 8, dim_out, compute=COMPUTE_32F, batch=num)

    def pair_outputs(self):
        """(P, D) float32: row p is pair p's expert output (moe.combine's y_pair)."""
        out = self.ops.empty((len(self.plan.pair_row), self.hidden))
        _launch(sum_parts_rows, out.shape[0], self.ops.stream, self.y_rows, self.table, self.tc.parts, out)
        return out


def _runs(sorted_values: np.ndarray):
    """(value, first index, length) of each run of equal values."""
    values, first, counts = np.unique(sorted_values, return_index=True, return_counts=True)
    return values, first, counts
