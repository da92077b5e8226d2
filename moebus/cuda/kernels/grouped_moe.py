"""The experts of a long step (prefill) on tensor cores, grouped by expert: the step's (token, choice)
pairs sorted by expert, so each active expert's tokens are consecutive rows; per expert one gate|up
product over its rows (the blob's gate (I x D) and up (I x D) are one (2I, D) matrix), SwiGLU over
all rows at once, one down product; the rows then go back to pair order for the combine that the
next norm fuses (moe.combine_ref). Experts are read from their arena slots (moe.py's blob layout).

Shapes: T tokens, A active experts per token, P = T * A pairs, G active experts, D hidden,
I expert intermediate."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moebus.cuda.kernels.compat import bits_as_f32, blocks, cuda, f32_bits, float32, kernel, threads, uint16
from moebus.cuda.kernels.elementwise import swiglu_ref
from moebus.cuda.kernels.gemm import address, split_bf16_ref
from moebus.cuda.kernels.launch import ceil_div, require

THREADS = 256


@dataclass
class PairPlan:
    """Pairs p = t * A + k sorted by expert (stable): sorted row r holds pair order[r]."""
    experts: np.ndarray  # (G,) the active experts, ascending
    starts: np.ndarray  # (G,) first sorted row of each
    counts: np.ndarray  # (G,) rows of each
    pair_token: np.ndarray  # (P,) int32: the token of each sorted row
    pair_row: np.ndarray  # (P,) int32: the sorted row of each pair p


def plan_pairs(ids: np.ndarray) -> PairPlan:
    # ids (T, A) int32 on the host
    flat = np.asarray(ids, dtype=np.int32).reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    pair_row = np.empty_like(order)
    pair_row[order] = np.arange(len(order))
    return PairPlan(experts, starts, counts, (order // ids.shape[1]).astype(np.int32), pair_row.astype(np.int32))


def swiglu_split_ref(gate_up: np.ndarray, parts: int) -> np.ndarray:
    # gate_up (R, 2I) float32 -> (parts, R, I) bf16 bits of silu(gate) * up
    inter = gate_up.shape[1] // 2
    return split_bf16_ref(swiglu_ref(gate_up[:, :inter], gate_up[:, inter:]), parts)


@kernel
def swiglu_split_rows(gate_up, first_row, num_rows, out):
    parts, _, inter = out.shape
    for n in range(cuda.grid(1), num_rows * inter, cuda.gridsize(1)):
        r, d = first_row + n // inter, n % inter
        g = gate_up[r, d]
        rest = float32(g / (float32(1.0) + math.exp(-g)) * gate_up[r, inter + d])
        for i in range(parts):
            bits = f32_bits(rest)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # gemm.split_rows
            out[i, r, d] = uint16(rounded)
            rest = float32(rest - bits_as_f32(rounded << 16))


def swiglu_split_cuda(gate_up, first_row: int, num_rows: int, out, stream=0):
    """out[:, rows] = swiglu_split_ref(gate_up[rows]) for rows first_row ... + num_rows."""
    require("gate_up", gate_up, np.float32, ndim=2)
    require("out", out, np.uint16, shape=(None, gate_up.shape[0], gate_up.shape[1] // 2))
    if num_rows:
        grid = blocks(ceil_div(num_rows * out.shape[2], THREADS))
        swiglu_split_rows[grid, threads(THREADS), stream](gate_up, int(first_row), int(num_rows), out)
    return out


class GroupedExperts:
    """One MoE layer of a long step: ``gate_up`` and ``down`` per group of resident experts (the
    caller acquires their slots), then ``pair_outputs`` (P, D) in pair order."""

    def __init__(self, ops, tensor_cores, h, plan: PairPlan, hidden: int, inter: int):
        self.ops, self.tc, self.hidden, self.inter = ops, tensor_cores, hidden, inter
        num_pairs = len(plan.pair_token)
        self.x_parts = tensor_cores.split(ops, h, rows=ops.upload(plan.pair_token))  # (parts, P, D)
        self.gate_up_out = ops.empty((num_pairs, 2 * inter))
        self.h_parts = ops.empty((tensor_cores.parts, num_pairs, inter), np.uint16)
        self.y = ops.empty((num_pairs, hidden))

    def _slot_address(self, arena, slot: int) -> int:
        return address(arena) + int(slot) * arena.shape[1] * arena.dtype.itemsize

    def gate_up(self, arena, slots, starts, counts) -> None:
        for slot, start, count in zip(slots, starts, counts):
            self.tc.matmul_nt(self.ops, self.x_parts, int(start), int(count), self._slot_address(arena, slot),
                              2 * self.inter, self.gate_up_out, out_row=int(start))

    def down(self, arena, slots, starts, counts) -> None:
        """SwiGLU over the group's rows (consecutive: its experts are), then the down products."""
        first, end = int(starts[0]), int(starts[-1] + counts[-1])
        swiglu_split_cuda(self.gate_up_out, first, end - first, self.h_parts, stream=self.ops.stream)
        down_offset = 2 * self.inter * self.hidden * arena.dtype.itemsize
        for slot, start, count in zip(slots, starts, counts):
            self.tc.matmul_nt(self.ops, self.h_parts, int(start), int(count),
                              self._slot_address(arena, slot) + down_offset, self.hidden, self.y, out_row=int(start))

    def pair_outputs(self, plan: PairPlan):
        """(P, D) float32: row p is pair p's expert output (moe.combine's y_pair)."""
        return self.ops.embedding(self.y, self.ops.upload(plan.pair_row))
