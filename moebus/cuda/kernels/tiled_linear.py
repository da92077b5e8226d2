"""Linear layer for many rows at once (a vision tower's patches, hundreds per image): out = x @ W^T
(+ bias) with W in the Hugging Face (out, in) layout, fp32 accumulation.

``linear.py``'s kernel is a GEMV that re-reads every token's activations for every output row,
which suits a decode step's few tokens. Here each block computes a TM x TN tile of the output from
TK-wide slabs of x and W staged in shared memory, and each thread an RM x RN micro-tile in
registers, so every loaded value is used TM or TN times. Each output is a sum in k order by one
thread: the result of a row does not depend on the other rows."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR, blocks, cuda, float32, kernel
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, ceil_div, require
from moebus.cuda.kernels.loads import SCALAR, reader_view, storage_of

# (TM, TN, TK, RM, RN): output tile, k slab, per-thread micro-tile. The simulator runs each thread
# as a Python thread, so it gets a tile of 16 threads that the tests' small shapes still cut.
TILE = (16, 16, 16, 4, 4) if SIMULATOR else (64, 64, 16, 4, 4)


def tiled_linear_ref(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    # x (M, K) float32, weight (N, K) stored, bias (N,) stored or None -> (M, N) float32
    out = np.asarray(x, dtype=np.float32) @ to_f32(weight).T
    return out if bias is None else out + to_f32(bias)


# -- cuda -----------------------------------------------------------------------------------------

@functools.cache
def _tiled_kernel(storage: str, with_bias: bool, tm: int, tn: int, tk: int, rm: int, rn: int):
    load = SCALAR[storage]
    num_threads = (tm // rm) * (tn // rn)
    threads_n = tn // rn
    rows_step, cols_step = tm // rm, tn // rn
    pad_m, pad_n = tm + 1, tn + 1  # padded slabs: the transposing stores hit distinct banks

    @kernel
    def tiled_linear(x, weight, bias, out):
        num_rows, dim_in = x.shape
        num_cols = weight.shape[0]
        x_slab = cuda.shared.array((tk, pad_m), float32)
        w_slab = cuda.shared.array((tk, pad_n), float32)
        acc = cuda.local.array((rm, rn), float32)
        a = cuda.local.array(rm, float32)
        b = cuda.local.array(rn, float32)
        tid = cuda.threadIdx.x
        ty, tx = tid // threads_n, tid % threads_n
        tiles_n = (num_cols + tn - 1) // tn
        num_tiles = ((num_rows + tm - 1) // tm) * tiles_n
        for tile in range(cuda.blockIdx.x, num_tiles, cuda.gridDim.x):  # same trip count in the block
            m0, n0 = (tile // tiles_n) * tm, (tile % tiles_n) * tn
            for i in range(rm):
                for j in range(rn):
                    acc[i, j] = float32(0.0)
            for k0 in range(0, dim_in, tk):
                for e in range(tid, tm * tk, num_threads):  # consecutive threads: consecutive k
                    r, c = e // tk, e % tk
                    ok = m0 + r < num_rows and k0 + c < dim_in
                    x_slab[c, r] = x[m0 + r, k0 + c] if ok else float32(0.0)
                for e in range(tid, tn * tk, num_threads):
                    r, c = e // tk, e % tk
                    ok = n0 + r < num_cols and k0 + c < dim_in
                    w_slab[c, r] = load(weight, n0 + r, k0 + c) if ok else float32(0.0)
                cuda.syncthreads()
                for c in range(tk):
                    for i in range(rm):
                        a[i] = x_slab[c, ty + i * rows_step]
                    for j in range(rn):
                        b[j] = w_slab[c, tx + j * cols_step]
                    for i in range(rm):
                        for j in range(rn):
                            acc[i, j] += a[i] * b[j]
                cuda.syncthreads()  # the slabs are refilled next
            for i in range(rm):
                m = m0 + ty + i * rows_step
                for j in range(rn):
                    n = n0 + tx + j * cols_step
                    if m < num_rows and n < num_cols:
                        out[m, n] = acc[i, j] + load(bias, 0, n) if with_bias else acc[i, j]

    return tiled_linear, num_threads


def tiled_linear_cuda(x, weight, bias, out, stream=0):
    """out (M, N) float32 = x (M, K) float32 @ weight (N, K) stored ^T (+ bias (N,) stored, or None)."""
    num_rows, dim_in = x.shape
    require("x", x, np.float32, ndim=2)
    require("weight", weight, WEIGHT_DTYPES, shape=(None, dim_in))
    num_cols = weight.shape[0]
    if bias is not None:
        require("bias", bias, (weight.dtype,), shape=(num_cols,))
    require("out", out, np.float32, shape=(num_rows, num_cols))
    if num_rows == 0 or num_cols == 0:
        return out
    tm, tn = TILE[0], TILE[1]
    kernel, num_threads = _tiled_kernel(storage_of(weight), bias is not None, *TILE)
    grid = blocks(ceil_div(num_rows, tm) * ceil_div(num_cols, tn))
    bias_view = reader_view(bias if bias is not None else weight[0], wide=False)  # never read without bias
    kernel[grid, num_threads, stream](x, weight, bias_view, out)
    return out
