"""The two implementations of gemm.py's ``Blas``: cuBLAS through nvmath-python (``cublas_blas``) and
numpy over the simulator's host memory (``HostBlas``), with one signature:

    gemm(stream, trans_a, trans_b, m, n, k, a, a_type, lda, b, b_type, ldb, c, ldc, alpha=1.0,
         beta=0.0, compute=COMPUTE_32F, batch=1, stride_a=0, stride_b=0, stride_c=0)

C (m x n, column-major, leading dimension ldc, float32) = alpha op(A) op(B) + beta C for each of
``batch`` problems, the i-th at a + i stride_a, b + i stride_b, c + i stride_c (elements). A and B
are float32 or bf16 (a_type, b_type: cudaDataType_t); addresses are plain integers.

    gemm_batched(stream, trans_a, trans_b, m, n, k, a_array, a_type, lda, b_array, b_type, ldb,
                 c_array, ldc, alpha=1.0, beta=0.0, compute=COMPUTE_32F, batch=1)

the same with the i-th problem's A, B, C at the addresses in device arrays of ``batch`` int64."""
from __future__ import annotations

import ctypes
import logging
import os
import time

import numpy as np

from moebus.cuda.dtypes import bf16_to_f32
from moebus.cuda.kernels.gemm import COMPUTE_32F, OP_N, R_16BF, R_32F, address

ITEMSIZE = {R_32F: 4, R_16BF: 2}
DEFAULT_ALGO = -1  # CUBLAS_GEMM_DEFAULT (tensor ops are allowed by default since cuBLAS 11)
# a cuBLAS call whose host time passes this is logged (its shape and time): with CUDA's lazy module
# loading a kernel's first launch loads it (~4.5 ms on the H200, eleventh session's trace), which is
# what the first image's spanning chunk met beside text streams (issue 20); 0: none logged
SLOW_CALL_S = float(os.environ.get("MOEBUS_CUBLAS_SLOW_CALL_MS", "2")) / 1e3
log = logging.getLogger("moebus.cublas")
# each handle's own workspace (cublasSetWorkspace), made with the handle: without it cuBLAS 12.2+ takes
# its workspace with cudaMallocAsync inside a graph capture, which puts memory alloc / free nodes in the
# decode graph, and the driver then refuses to edit its edges (pdl.py: batch 8's graph, thirteenth
# session). 32 MiB is what cuBLAS asks for on Hopper. The handle's calls run in one stream order (the
# backend's stream, which replays the graphs it captured), so one workspace serves them all. It is set
# again after every cublasSetStream, which puts the handle back on cuBLAS's own pool (the cuBLAS docs:
# "unconditionally resets the cuBLAS library workspace"; the thirteenth session set it once, after the
# first set_stream only, and batch 8's graphs still held 241 alloc nodes: call 2).
# 0: cuBLAS's own (MOEBUS_CUBLAS_WORKSPACE_MB)
WORKSPACE_BYTES = int(float(os.environ.get("MOEBUS_CUBLAS_WORKSPACE_MB", "32")) * (1 << 20))


class HostBlas:
    """cuBLAS's gemm on numpy, for the simulator: the device arrays are host memory there."""

    def gemm(self, stream, trans_a, trans_b, m, n, k, a, a_type, lda, b, b_type, ldb, c, ldc, alpha=1.0,
             beta=0.0, compute=COMPUTE_32F, batch=1, stride_a=0, stride_b=0, stride_c=0):
        for i in range(batch):
            op_a = _matrix(a + i * stride_a * ITEMSIZE[a_type], a_type, *((m, k) if trans_a == OP_N else (k, m)), lda)
            op_b = _matrix(b + i * stride_b * ITEMSIZE[b_type], b_type, *((k, n) if trans_b == OP_N else (n, k)), ldb)
            op_a = op_a if trans_a == OP_N else op_a.T
            op_b = op_b if trans_b == OP_N else op_b.T
            out = _view(c + i * stride_c * 4, np.float32, m, n, ldc)
            with np.errstate(over="ignore", invalid="ignore"):  # padding rows hold whatever was there
                # summed in float64, then rounded once: OpenBLAS's sgemm sums a row in an order that depends on
                # where the row sits in the tile (its edge kernels), and plan_on_device ranks an expert's pairs
                # by atomics, so the same token's row came out 1 ulp apart between runs (CI, seventeenth session)
                exact = _as_f64(op_a, a_type) @ _as_f64(op_b, b_type)
                product = np.float32(alpha) * exact.astype(np.float32)
            out[...] = product if beta == 0.0 else product + np.float32(beta) * out

    def gemm_batched(self, stream, trans_a, trans_b, m, n, k, a_array, a_type, lda, b_array, b_type, ldb, c_array,
                     ldc, alpha=1.0, beta=0.0, compute=COMPUTE_32F, batch=1):
        pointers = [_view(at, np.int64, batch, 1, batch)[:, 0] for at in (a_array, b_array, c_array)]
        for a, b, c in zip(*pointers):
            self.gemm(stream, trans_a, trans_b, m, n, k, int(a), a_type, lda, int(b), b_type, ldb, int(c), ldc,
                      alpha=alpha, beta=beta, compute=compute)


def _view(address: int, dtype, rows: int, cols: int, ld: int) -> np.ndarray:
    """The column-major rows x cols matrix at ``address`` as a strided numpy view."""
    dtype = np.dtype(dtype)
    count = (cols - 1) * ld + rows if rows and cols else 0
    flat = np.ctypeslib.as_array((ctypes.c_byte * (count * dtype.itemsize)).from_address(address)).view(dtype)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (dtype.itemsize, ld * dtype.itemsize))


def _matrix(address: int, data_type: int, rows: int, cols: int, ld: int) -> np.ndarray:
    return _view(address, np.uint16 if data_type == R_16BF else np.float32, rows, cols, ld)


def _as_f64(matrix: np.ndarray, data_type: int) -> np.ndarray:
    return (bf16_to_f32(matrix) if data_type == R_16BF else np.asarray(matrix, np.float32)).astype(np.float64)


class _Cublas:
    """One cuBLAS handle (made at the first product, in the context current then); host scalars."""

    def __init__(self, cublas):
        self.cublas = cublas
        self.handle = None
        self.scalars = np.zeros(8, np.float32)  # alpha, beta of the call in flight (pointer mode host)
        self.slow_calls = 0  # calls that took SLOW_CALL_S or more of host time
        self.workspace = None  # WORKSPACE_BYTES of device memory, for the handle's life

    def gemm(self, stream, trans_a, trans_b, m, n, k, a, a_type, lda, b, b_type, ldb, c, ldc, alpha=1.0,
             beta=0.0, compute=COMPUTE_32F, batch=1, stride_a=0, stride_b=0, stride_c=0):
        cublas = self.cublas
        alpha_ptr, beta_ptr = self._prepare(stream, alpha, beta)
        started = time.perf_counter()
        if batch == 1:
            cublas.gemm_ex(self.handle, trans_a, trans_b, m, n, k, alpha_ptr, a, a_type, lda, b, b_type, ldb, beta_ptr,
                           c, R_32F, ldc, compute, DEFAULT_ALGO)
        else:
            cublas.gemm_strided_batched_ex(self.handle, trans_a, trans_b, m, n, k, alpha_ptr, a, a_type, lda, stride_a,
                                           b, b_type, ldb, stride_b, beta_ptr, c, R_32F, ldc, stride_c, batch,
                                           compute, DEFAULT_ALGO)
        self._note(started, "gemm", m, n, k, batch)

    def gemm_batched(self, stream, trans_a, trans_b, m, n, k, a_array, a_type, lda, b_array, b_type, ldb, c_array,
                     ldc, alpha=1.0, beta=0.0, compute=COMPUTE_32F, batch=1):
        alpha_ptr, beta_ptr = self._prepare(stream, alpha, beta)
        started = time.perf_counter()
        self.cublas.gemm_batched_ex(self.handle, trans_a, trans_b, m, n, k, alpha_ptr, a_array, a_type, lda, b_array,
                                    b_type, ldb, beta_ptr, c_array, R_32F, ldc, batch, compute, DEFAULT_ALGO)
        self._note(started, "gemm_batched", m, n, k, batch)

    def _note(self, started: float, kind: str, m: int, n: int, k: int, batch: int) -> None:
        """Log a call whose host time passed SLOW_CALL_S (a kernel loaded at its first launch)."""
        seconds = time.perf_counter() - started
        if 0 < SLOW_CALL_S <= seconds:
            self.slow_calls += 1
            log.info("cuBLAS %s m %d n %d k %d batch %d took %.1f ms of host time (slow call %d: a kernel's first "
                     "load?)", kind, m, n, k, batch, 1e3 * seconds, self.slow_calls)

    def _prepare(self, stream, alpha: float, beta: float) -> tuple[int, int]:
        if self.handle is None:
            self.handle = self.cublas.create()
            if WORKSPACE_BYTES > 0:
                from moebus.cuda.kernels.compat import cuda

                self.workspace = cuda.device_array(WORKSPACE_BYTES, np.uint8)
        self.cublas.set_stream(self.handle, stream_handle(stream))
        if self.workspace is not None:  # cublasSetStream "unconditionally resets the workspace" (cuBLAS docs)
            self.cublas.set_workspace(self.handle, address(self.workspace), WORKSPACE_BYTES)
        self.scalars[0], self.scalars[1] = alpha, beta
        return self.scalars.ctypes.data, self.scalars.ctypes.data + 4


def stream_handle(stream) -> int:
    """The CUstream of a numba stream (0: the default stream)."""
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    handle = getattr(stream, "handle", stream)
    return int(getattr(handle, "value", handle) or 0)


def cublas_blas() -> _Cublas:
    """cuBLAS through nvmath-python; ImportError where it is not installed."""
    from nvmath.bindings import cublas

    return _Cublas(cublas)
