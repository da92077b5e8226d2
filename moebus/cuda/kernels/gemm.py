"""Tensor-core matrix products for steps of many tokens (prefill, the vision tower, experts that get
many tokens): cuBLAS through nvmath-python's bindings, on the backend's stream, fp32 accumulation.

Weights stay bf16 as stored. Activations are float32 everywhere in the model, and a tensor-core
product takes bf16 inputs, so x is split into hi = bf16(x) and lo = bf16(x - hi) and the product is
W hi + W lo: two GEMMs, the second accumulating into the first (precision "split"). x is then held
to ~2^-16 relative, the weights exactly, the sums in fp32: close to the GEMV path's fp32 arithmetic
(tests/test_fidelity's 1e-3 on logits). Precision "bf16" rounds x once (half the work, ~2^-9).

``Blas``: the cuBLAS calls used, column-major as cuBLAS defines them, on raw device addresses.
``cublas_blas()`` binds them to nvmath (imported lazily: an optional dependency, the ``cuda``
extra); ``HostBlas`` (gemm_host.py) runs the same calls on numpy so that the simulator (CI) checks
every layout. A row-major (R, C) array is a column-major C x R matrix with leading dimension C.

Shapes: T rows (tokens), K inputs, N outputs."""
from __future__ import annotations

import functools
import logging
import os

import numpy as np

from moebus.cuda.dtypes import bf16_to_f32, f32_to_bf16, to_f32
from moebus.cuda.kernels.compat import SIMULATOR, bits_as_f32, blocks, cuda, f32_bits, float32, kernel, threads, uint16
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import require
from moebus.cuda.kernels.loads import load_bf16

log = logging.getLogger("moebus.cuda")
ROW_THREADS = 512  # the conversion kernels: a block per row (decode11 on an H200: split_rows 7.5 -> 3.6 us at 8 rows)
# steps of >= 33 tokens (decode of 33+ sequences too) on tensor cores: decode of 64 sequences at 48 x 32 took
# 23.2 ms a step with 65 here and 13.3 with 33 (H200, tools/device/merged7.sh); smaller steps keep their GEMVs
MIN_ROWS = int(os.environ.get("MOEBUS_GEMM_MIN_ROWS", "33"))
# decode steps of FEW_ROWS ... MIN_ROWS - 1 tokens: their dense products (backend ``linear``: q/k/v, o,
# lm_head) in one product over the split parts as 2 x rows columns (the weights read once), then the
# parts summed (``linear_few``); 0: never. H200, 48 x 32, experts in tiles: batch 8 8.73 -> 8.60 ms a
# step, batch 16 10.60 -> 8.75; batch 4 6.58 -> 7.33 (slower: hence 8) (docs/performance.md, branch tc8)
FEW_ROWS = int(os.environ.get("MOEBUS_GEMM_FEW_ROWS", "8"))
PRECISION = os.environ.get("MOEBUS_GEMM_PRECISION", "split")
PARTS = {"split": 2, "bf16": 1}
R_32F, R_16BF = 0, 14  # cudaDataType_t
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77  # cublasComputeType_t
OP_N, OP_T = 0, 1


def split_bf16_ref(x: np.ndarray, parts: int = 2) -> np.ndarray:
    # x (T, K) float32 -> (parts, T, K) bf16 bits: hi = bf16(x), lo = bf16(x - hi)
    x = np.asarray(x, dtype=np.float32)
    out, rest = [], x
    for _ in range(parts):
        out.append(f32_to_bf16(rest))
        rest = rest - bf16_to_f32(out[-1])
    return np.stack(out)


def gemm_linear_ref(x: np.ndarray, weight: np.ndarray, parts: int = 2) -> np.ndarray:
    """What the tensor cores compute for x @ weight^T: the split parts times the bf16 weights."""
    w = to_f32(weight)
    return sum(bf16_to_f32(p) @ w.T for p in split_bf16_ref(x, parts)).astype(np.float32)


# -- cuda: float32 -> bf16 parts ---------------------------------------------------------------------

@kernel
def split_rows(x, rows, gather, out):
    # out[i, r] = part i of x[rows[r] if gather else r]; out (parts, R, K) uint16
    # a block per row (grid-stride), threads along it: no index arithmetic per element
    grid_dependency_wait()  # pdl.py: before any global read or write
    parts, num_rows, dim = out.shape
    for r in range(cuda.blockIdx.x, num_rows, cuda.gridDim.x):
        source = rows[r] if gather else r
        for d in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
            rest = x[source, d]
            for i in range(parts):
                bits = f32_bits(rest)
                rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest even (f32_to_bf16)
                out[i, r, d] = uint16(rounded)
                rest = float32(rest - bits_as_f32(rounded << 16))


def split_rows_cuda(x, out, rows=None, stream=0):
    """out (parts, R, K) bf16 bits = split_bf16_ref(x[rows] (or x), parts), x (T, K) float32."""
    require("x", x, np.float32, ndim=2)
    require("out", out, np.uint16, shape=(None, None, x.shape[1]))
    gather = rows is not None
    if gather:
        require("rows", rows, np.int32, shape=(out.shape[1],))
    elif out.shape[1] != x.shape[0]:
        raise ValueError(f"out: {out.shape[1]} rows for {x.shape[0]} rows of x")
    if out.size:
        split_rows[blocks(out.shape[1]), threads(ROW_THREADS), stream](x, rows if gather else _no_rows(), gather, out)
    return out


@kernel
def sum_parts(y, out):
    # out[i] = sum over parts q of y[q, i]; y (parts, n), out (n,) float32: flat, grid-stride
    grid_dependency_wait()  # pdl.py: before any global read or write
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        total = float32(0.0)
        for q in range(y.shape[0]):
            total += y[q, i]
        out[i] = total


def sum_parts_cuda(y, out, stream=0):
    """out (R, N) float32 = y (parts, R, N) summed over its parts (the few-rows product's outputs)."""
    require("out", out, np.float32, ndim=2)
    require("y", y, np.float32, shape=(None, *out.shape))
    if out.size:
        flat = out.size
        sum_parts[blocks(min(-(-flat // ROW_THREADS), 4096)), threads(ROW_THREADS), stream](
            y.reshape(y.shape[0], flat), out.reshape(flat))
    return out


@kernel
def add_bias_rows(out, bias):
    # out (T, N) float32 += bias (1, N) bf16 bits, in place; a block per row, threads along it
    grid_dependency_wait()  # pdl.py: before any global read or write
    for r in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
        for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
            out[r, d] += load_bf16(bias, 0, d)


def add_bias_rows_cuda(out, bias, stream=0):
    """out += bias in place: out (T, N) float32, bias (N,) bf16 bits (activations.add_bias_ref)."""
    require("out", out, np.float32, ndim=2)
    require("bias", bias, np.uint16, shape=(out.shape[1],))
    if out.size:
        add_bias_rows[blocks(out.shape[0]), threads(ROW_THREADS), stream](out, bias.reshape(1, out.shape[1]))
    return out


@functools.cache
def _no_rows():
    # never read: the rows argument when not gathering (no copy: to_device's synchronous copy, made first inside a
    # stream capture — a tower's slice captured before any eager run — would invalidate it)
    return cuda.device_array(1, np.int32)


# -- the products ---------------------------------------------------------------------------------

def address(array) -> int:
    """The data address of a device array (numba), or of the simulator's host stand-in."""
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is not None:
        return int(interface["data"][0])
    return int(getattr(array, "_ary", array).__array_interface__["data"][0])


class TensorCores:
    """The multi-token products of one backend: ``blas`` (cublas_blas() or HostBlas) on the
    backend's stream; rows >= ``min_rows`` and bf16 weights take this path, the rest their GEMVs."""

    def __init__(self, blas, precision: str = PRECISION, min_rows: int = MIN_ROWS, few_rows: int = FEW_ROWS):
        if precision not in PARTS:
            raise ValueError(f"gemm precision {precision!r}: expected one of {sorted(PARTS)}")
        self.blas, self.parts, self.min_rows = blas, PARTS[precision], int(min_rows)
        self.few_rows = int(few_rows)  # the backend's ``linear`` from this many rows (0: from min_rows)
        self.precision = precision

    def wants(self, num_rows: int, weight) -> bool:
        return num_rows >= self.min_rows and weight.dtype == np.uint16 and len(weight.shape) == 2

    def takes_linear(self, num_rows: int, weight) -> bool:
        """The backend's ``linear`` (a step's dense products, lm_head): ``wants``, or a few rows from
        ``few_rows`` on (decode of several sequences, linear_few)."""
        if self.wants(num_rows, weight):
            return True
        few = 0 < self.few_rows <= num_rows
        return few and weight.dtype == np.uint16 and len(weight.shape) == 2

    def split(self, ops, x, rows=None):
        """(parts, R, K) bf16 bits of x (or of its rows ``rows``, a device int32 array)."""
        num_rows = x.shape[0] if rows is None else rows.shape[0]
        out = ops.empty((self.parts, num_rows, x.shape[1]), np.uint16)
        return split_rows_cuda(x, out, rows, stream=ops.stream)

    def matmul_nt(self, ops, parts, first_row: int, num_rows: int, weight_ptr: int, num_out: int, out,
                  out_row: int = 0, accumulate: bool = False, out_col: int = 0) -> None:
        """out[out_row : out_row + num_rows, out_col : out_col + num_out] (+)= x @ W^T over the split
        ``parts`` (rows first_row...), W a row-major (num_out, K) bf16 matrix at ``weight_ptr``; out
        (., N) float32 (``out_col``: W a slice of a larger weight's rows, linear_quant_slices.py)."""
        _, total_rows, dim_in = parts.shape
        if num_rows == 0:
            return
        row_bytes, part_bytes, ldc = dim_in * 2, total_rows * dim_in * 2, out.shape[1]
        assert out_col + num_out <= ldc, "the product's columns past out's"
        c = address(out) + (out_row * ldc + out_col) * 4
        for i in range(self.parts):
            b = address(parts) + i * part_bytes + first_row * row_bytes
            self.blas.gemm(ops.stream, OP_T, OP_N, num_out, num_rows, dim_in, weight_ptr, R_16BF, dim_in, b, R_16BF,
                           dim_in, c, ldc, beta=1.0 if (accumulate or i) else 0.0, compute=COMPUTE_32F)

    def linear(self, ops, x, weight, out, bias=None):
        """out (T, N) float32 = x (T, K) float32 @ weight (N, K) bf16 ^T (+ bias (N,) bf16)."""
        require("x", x, np.float32, ndim=2)
        require("weight", weight, np.uint16, shape=(None, x.shape[1]))
        require("out", out, np.float32, shape=(x.shape[0], weight.shape[0]))
        parts = self.split(ops, x)
        if x.shape[0] < self.min_rows and self.parts > 1:
            self.linear_few(ops, parts, address(weight), weight.shape[0], out)
        else:
            self.matmul_nt(ops, parts, 0, x.shape[0], address(weight), weight.shape[0], out)
        return out if bias is None else add_bias_rows_cuda(out, bias, stream=ops.stream)

    def linear_few(self, ops, parts, weight_ptr: int, num_out: int, out) -> None:
        """out (R, num_out) = x @ W^T for a few rows: one product over all the split ``parts`` (parts,
        R, K) as parts x R columns, so the weights are read once (the two products of matmul_nt read
        them twice: a step of few rows is bound by those reads), then the parts summed."""
        num_parts, num_rows, dim_in = parts.shape
        y = ops.empty((num_parts, num_rows, num_out))
        self.blas.gemm(ops.stream, OP_T, OP_N, num_out, num_parts * num_rows, dim_in, weight_ptr, R_16BF, dim_in,
                       address(parts), R_16BF, dim_in, address(y), num_out, beta=0.0, compute=COMPUTE_32F)
        sum_parts_cuda(y, out, stream=ops.stream)


def make_tensor_cores():
    """TensorCores on cuBLAS, or None (with a warning) where nvmath-python is missing or
    MOEBUS_TENSOR_CORES=0: multi-token steps then run on the GEMV kernels."""
    if SIMULATOR or os.environ.get("MOEBUS_TENSOR_CORES", "1") == "0":
        return None
    try:
        from moebus.cuda.kernels.gemm_host import cublas_blas

        return TensorCores(cublas_blas())
    except ImportError as e:
        log.warning("nvmath-python is not installed (%s): prefill and the vision tower run on the GEMV kernels, "
                    "without tensor cores (pip install 'moebus[cuda]')", e)
        return None
