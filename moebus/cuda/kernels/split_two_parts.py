"""split_epilogues.py's stores and its bias + activation kernel for a product's input of two parts (the
towers' split precision), with unsigned columns: numba wraps a negative signed index around (a
compare and a select per index), and the parts' loop runs to a count known only at run time, so the
compiled kernels spent most of their instructions on 64-bit index arithmetic. Here the columns are
unsigned (no wraparound to compute), the two parts' stores are written out, and the values and
roundings are split_epilogues.py's (bit for bit: tests/cuda/test_split_two_parts.py; on the H200 the a3b
tower's bias + GELU 50.2 -> 42.1 us a call, its outputs unchanged: docs/performance.md, fifteenth session).

``TWO_PARTS`` (``MOEBUS_SPLIT_TWO_PARTS``, default 1; 0 for split_epilogues.py's kernels) is read where
split_epilogues.bias_activation_split_cuda chooses."""
from __future__ import annotations

import functools
import os

from moebus.cuda.kernels.activations import DEVICE_FNS
from moebus.cuda.kernels.compat import bits_as_f32, cuda, device, f32_bits, float32, kernel, uint16, uint32, uint64
from moebus.cuda.kernels.loads import SCALAR
from moebus.cuda.kernels.pdl import grid_dependency_wait

TWO_PARTS = os.environ.get("MOEBUS_SPLIT_TWO_PARTS", "1") != "0"


@device
def bf16_rounded(value):
    # bf16 bits of value, rounded to nearest even (f32_to_bf16, split_epilogues._store_split)
    bits = f32_bits(value)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@device
def store_two_parts(out, r, d, value):
    # out[:, r, d] = the two parts of value, as split_epilogues._store_split computes them
    hi = bf16_rounded(value)
    out[0, r, d] = uint16(hi)
    out[1, r, d] = uint16(bf16_rounded(float32(value - bits_as_f32(hi << 16))))


@device
def store_two_parts_pair(out, r, j, value0, value1):
    # out[:, r, j] = the two parts of value0 (low half) and value1 (high half), as split_epilogues._store_split_pair
    hi0, hi1 = bf16_rounded(value0), bf16_rounded(value1)
    out[0, r, j] = uint32(hi0 | (hi1 << 16))
    lo0 = bf16_rounded(float32(value0 - bits_as_f32(hi0 << 16)))
    lo1 = bf16_rounded(float32(value1 - bits_as_f32(hi1 << 16)))
    out[1, r, j] = uint32(lo0 | (lo1 << 16))


@functools.cache
def bias_activation_pairs_kernel(storage: str, name: str):
    """split_epilogues._bias_activation_split_pairs_kernel for two parts, unsigned columns."""
    load, fn = SCALAR[storage], DEVICE_FNS[name]

    @kernel
    def bias_activation_two_parts(y, bias, out):
        # out (2, R, D / 2) uint32 = the parts of fn(y[r, d] + bias[d]) for d = 2j (low half), 2j + 1 (high
        # half); a block per row, each thread's two pairs (a block's width apart) loaded before any is computed
        grid_dependency_wait()  # pdl.py: before any global read or write
        pairs, step = uint64(out.shape[2]), uint64(cuda.blockDim.x)
        for r in range(cuda.blockIdx.x, y.shape[0], cuda.gridDim.x):
            for j in range(uint64(cuda.threadIdx.x), pairs, 2 * step):
                j1 = j + step if j + step < pairs else j  # (a clamped second pair: loaded, never stored)
                d0, d1 = 2 * j, 2 * j1
                y0, y1, y2, y3 = y[r, d0], y[r, d0 + 1], y[r, d1], y[r, d1 + 1]
                b0, b1 = load(bias, 0, d0), load(bias, 0, d0 + 1)
                b2, b3 = load(bias, 0, d1), load(bias, 0, d1 + 1)
                store_two_parts_pair(out, r, j, fn(y0 + b0), fn(y1 + b1))
                if j + step < pairs:
                    store_two_parts_pair(out, r, j1, fn(y2 + b2), fn(y3 + b3))

    return bias_activation_two_parts
