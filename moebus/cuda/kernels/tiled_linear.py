"""Linear layer for many rows at once (a vision tower's patches, hundreds per image): out = x @ W^T
(+ bias) with W in the Hugging Face (out, in) layout, fp32 accumulation.

``linear.py``'s kernel is a GEMV that re-reads every token's activations for every output row,
which suits a decode step's few tokens. Here each block computes a TM x TN tile of the output from
TK-wide slabs of x and W staged in shared memory, and each thread an RM x RN micro-tile in
registers, so every loaded value is used TM or TN times. Each output is a sum in k order by one
thread: the result of a row does not depend on the other rows.

Its bias can instead be added by the op that reads the product next (``bias_activation``,
``bias_residual``): the tensor-core path (gemm.py) would add it in a pass of its own over the whole
output, and these add it where the output is read anyway, with the same float32 additions in the
same order as the product with its bias followed by that op."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.activations import DEVICE_FNS, activation_ref
from moebus.cuda.kernels.compat import SIMULATOR, blocks, cuda, float32, kernel, threads
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, ceil_div, require
from moebus.cuda.kernels.loads import SCALAR, reader_view, storage_of

# (TM, TN, TK, RM, RN): output tile, k slab, per-thread micro-tile. The simulator runs each thread
# as a Python thread, so it gets a tile of 16 threads that the tests' small shapes still cut.
TILE = (16, 16, 16, 4, 4) if SIMULATOR else (64, 64, 16, 4, 4)
ROW_THREADS = 32 if SIMULATOR else 256  # the epilogues: a block per row, threads along it


def tiled_linear_ref(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    # x (M, K) float32, weight (N, K) stored, bias (N,) stored or None -> (M, N) float32
    out = np.asarray(x, dtype=np.float32) @ to_f32(weight).T
    return out if bias is None else out + to_f32(bias)


def bias_activation_ref(y: np.ndarray, bias: np.ndarray, name: str) -> np.ndarray:
    # y (R, D) float32, bias (D,) stored -> activation(y + bias), (R, D) float32
    return activation_ref(np.asarray(y, np.float32) + to_f32(bias), name)


def bias_residual_ref(x: np.ndarray, y: np.ndarray, bias: np.ndarray) -> np.ndarray:
    # x, y (R, D) float32, bias (D,) stored -> x + (y + bias), (R, D) float32
    return (np.asarray(x, np.float32) + (np.asarray(y, np.float32) + to_f32(bias))).astype(np.float32)


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


# -- the epilogues --------------------------------------------------------------------------------

@functools.cache
def _bias_activation_kernel(storage: str, name: str):
    load, fn = SCALAR[storage], DEVICE_FNS[name]

    @kernel
    def bias_activation(y, bias, out):
        # out[r, d] = fn(y[r, d] + bias[d]); a block per row (grid-stride), threads along it
        for r in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
            for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
                out[r, d] = fn(y[r, d] + load(bias, 0, d))

    return bias_activation


@functools.cache
def _bias_residual_kernel(storage: str):
    load = SCALAR[storage]

    @kernel
    def bias_residual(x, y, bias, out):
        # out[r, d] = x[r, d] + (y[r, d] + bias[d]); a block per row (grid-stride), threads along it
        for r in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
            for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
                out[r, d] = x[r, d] + (y[r, d] + load(bias, 0, d))

    return bias_residual


def _check_bias(y, bias, out) -> None:
    require("y", y, np.float32, ndim=2)
    require("bias", bias, WEIGHT_DTYPES, shape=(y.shape[1],))
    require("out", out, np.float32, shape=tuple(y.shape))


def bias_activation_cuda(y, bias, name: str, out, stream=0):
    """out = bias_activation_ref(y, bias, name): y, out (R, D) float32, bias (D,) stored."""
    if name not in DEVICE_FNS:
        raise ValueError(f"unknown activation {name!r} (known: {sorted(DEVICE_FNS)})")
    _check_bias(y, bias, out)
    if y.size:
        kernel = _bias_activation_kernel(storage_of(bias), name)
        kernel[blocks(y.shape[0]), threads(ROW_THREADS), stream](y, reader_view(bias, wide=False), out)
    return out


def bias_residual_cuda(x, y, bias, out, stream=0):
    """out = bias_residual_ref(x, y, bias): x, y, out (R, D) float32, bias (D,) stored."""
    _check_bias(y, bias, out)
    require("x", x, np.float32, shape=tuple(y.shape))
    if y.size:
        kernel = _bias_residual_kernel(storage_of(bias))
        kernel[blocks(y.shape[0]), threads(ROW_THREADS), stream](x, y, reader_view(bias, wide=False), out)
    return out
