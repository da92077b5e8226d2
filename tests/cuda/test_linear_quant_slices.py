"""An FP8 projection over many rows on the tensor cores, dequantized a bounded slice of rows at a time
(linear_quant_slices.py, the FP8 lm_head's long steps): the same products as the whole weight
dequantized once, with no scratch larger than a slice. HostBlas stands in for cuBLAS in the
simulator (test_gemm.py)."""
import numpy as np
import pytest

from moebus.common.fp8_dense import fp8_rows
from moebus.cuda.backends.cuda import CudaBackend
from moebus.cuda.kernels import linear_quant_slices
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import TensorCores, gemm_linear_ref
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.cuda.kernels.linear_quant import fp8_to_bf16_ref, linear_fp8_ref
from tests.cuda.test_linear_quant import _weight

MIN_ROWS = 3


class ScratchLog:
    """Inside a with-block, wraps a backend's ``empty`` and keeps the bytes of each bf16 (uint16)
    buffer taken."""

    def __init__(self, ops):
        self.ops, self.inner, self.bf16_bytes = ops, ops.empty, []

    def __enter__(self):
        self.ops.empty = self
        return self

    def __exit__(self, *exc):
        del self.ops.empty  # the class's method again

    def __call__(self, shape, dtype=np.float32):
        if np.dtype(dtype) == np.uint16:
            self.bf16_bytes.append(int(np.prod(shape)) * 2)
        return self.inner(shape, dtype)


@pytest.fixture
def ops():
    backend = CudaBackend()
    backend.tensor_cores = TensorCores(HostBlas() if SIMULATOR else cublas_blas(), min_rows=MIN_ROWS)
    backend.begin_step()
    return backend


def test_slices_hold_whole_rows_within_the_bound():
    assert linear_quant_slices.slice_rows(151_936, 2048, 32 << 20) == 8192  # the A3B lm_head: 19 slices
    assert linear_quant_slices.slice_rows(5120, 2048, 32 << 20) == 5120  # its fused qkv: one slice, as before
    assert linear_quant_slices.slice_rows(70, 4096, 1000) == 1  # a row wider than the bound: one row a slice


@pytest.mark.parametrize("tokens", [MIN_ROWS, 9])
def test_the_slices_give_the_whole_weights_products(ops, rng, monkeypatch, tokens):
    rows, cols, slice_rows = 70, 136, 16  # 4 whole slices and a partial one; 136: a partial scale block
    monkeypatch.setattr(linear_quant_slices, "SLICE_BYTES", slice_rows * cols * 2)
    codes, scales = fp8_rows(_weight(rng, rows, cols))
    x = rng.standard_normal((tokens, cols), dtype=np.float32)
    weight = ops.fp8_weight(codes, scales)
    with ScratchLog(ops) as scratch:
        out = ops.to_host(ops.linear(ops.upload(x), weight))
    np.testing.assert_allclose(out, gemm_linear_ref(x, fp8_to_bf16_ref(codes, scales)), rtol=1e-5, atol=1e-5)
    expected = linear_fp8_ref(x, codes, scales)  # bf16 holds e4m3 times a scale to 8 bits: within 2^-8
    np.testing.assert_allclose(out, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())
    # x's split parts (2 x tokens x cols) and one slice's scratch: never the whole weight as bf16
    assert sorted(scratch.bf16_bytes) == sorted([2 * tokens * cols * 2, slice_rows * cols * 2])


def test_fewer_rows_than_the_tensor_cores_take_read_fp8_in_the_gemv(ops, rng, monkeypatch):
    calls = []
    monkeypatch.setattr(linear_quant_slices, "linear_fp8_sliced", lambda *a: calls.append(a))
    codes, scales = fp8_rows(_weight(rng, 20, 64))
    x = rng.standard_normal((MIN_ROWS - 1, 64), dtype=np.float32)
    out = ops.to_host(ops.linear(ops.upload(x), ops.fp8_weight(codes, scales)))
    np.testing.assert_allclose(out, linear_fp8_ref(x, codes, scales), rtol=1e-4, atol=1e-4)
    assert not calls
