"""Helpers for the kernel tests. They run under numba's simulator by default and on a real GPU with
MOEBUS_TEST_GPU=1 (tolerances allow for the GPU's fused multiply-adds and expf). Under the simulator
every CUDA thread is a Python thread and a barrier waits on the interpreter's thread switch; a short
switch interval makes barriers several times cheaper, so it is shortened for this folder only."""
import sys
import zlib

import numpy as np
import pytest

from moebus.cuda.dtypes import f32_to_bf16

POISON = np.float32(np.nan)
STORAGES = ("bf16", "f16", "f32")


@pytest.fixture(autouse=True, scope="session")
def fast_thread_switch():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    yield
    sys.setswitchinterval(previous)


@pytest.fixture
def exact_quant_kernels(monkeypatch):
    """The quantized GEMVs on the numba kernels (moe_quant_mma.FORMATS empty: MOEBUS_QUANT_MMA=0), for tests of
    those kernels' own paths and bits; the tensor-core path, on by default on a GPU, rounds x to f16 and has its
    own tests against them (test_moe_quant_mma.py, test_linear_quant_mma.py)."""
    from moebus.cuda.kernels import moe_quant_mma

    monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset())


@pytest.fixture
def rng(request):
    # fresh random inputs per test, reproducible from the test's name
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def stored(values: np.ndarray, storage: str) -> np.ndarray:
    """float32 values in a weight storage dtype (bf16 as uint16 bits)."""
    if storage == "bf16":
        return f32_to_bf16(values)
    return np.ascontiguousarray(values, dtype=np.float16 if storage == "f16" else np.float32)


def poisoned(shape, dtype=np.float32):
    """A device array full of NaN (or -1 for integers) so that unwritten elements fail a comparison."""
    from moebus.cuda.kernels.compat import cuda

    fill = POISON if np.dtype(dtype).kind == "f" else -1
    return cuda.to_device(np.full(shape, fill, dtype=dtype))


def device(array):
    from moebus.cuda.kernels.compat import cuda

    return cuda.to_device(np.ascontiguousarray(array))


def nmse(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.sum((actual - expected) ** 2) / max(np.sum(expected**2), 1e-30))
