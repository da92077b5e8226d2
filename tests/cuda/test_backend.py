import inspect

import numpy as np
import pytest

from moebus.cuda.backends.cpu import CpuBackend
from moebus.cuda.backends import make_backend
from moebus.cuda.backends.cuda import CudaBackend
from moebus.cuda.memory.step_pool import StepPool

OPS = ["embedding", "rmsnorm", "add_rmsnorm", "combine_add_rmsnorm", "qkv_rope_store", "linear", "add", "swiglu",
       "rope", "kv_store", "attention", "topk_softmax", "route_pairs", "expert_ffn", "top_logprobs", "combine",
       "sample", "apply_rules", "token_logprobs", "takes_rope_attention", "rope_attention"]


def _public(cls):
    return {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}


def test_cuda_backend_offers_every_cpu_call_with_the_same_parameters():
    assert make_backend("cuda").name == "cuda"
    assert _public(CpuBackend) <= _public(CudaBackend)
    for name in OPS:
        cpu = list(inspect.signature(getattr(CpuBackend, name)).parameters)
        cuda = list(inspect.signature(getattr(CudaBackend, name)).parameters)[1:]  # less self
        assert cuda == cpu, name


def test_step_buffers_come_back_in_the_same_order_next_step():
    backend = CudaBackend()
    backend.begin_step()
    first = [backend.empty((3, 4)), backend.empty((2,), np.int32), backend.empty((3, 4))]
    assert first[0] is not first[2]
    backend.begin_step()
    again = [backend.empty((3, 4)), backend.empty((2,), np.int32), backend.empty((3, 4))]
    assert all(a is b for a, b in zip(first, again))  # no allocation, no new array objects


def test_pool_shares_one_size_class_between_shapes():
    made = []
    pool = StepPool(lambda shape, dtype: made.append(shape) or np.empty(shape, dtype))
    pool.take((10,), np.float32)
    pool.recycle()
    pool.take((5, 6), np.float32)  # 120 bytes: the same 256-byte class as 40 bytes
    assert made == [(256,)]


def test_upload_to_host_and_persistent_zeros():
    backend = CudaBackend()
    backend.begin_step()
    host = np.arange(12, dtype=np.int32).reshape(3, 4)
    np.testing.assert_array_equal(backend.to_host(backend.upload(host)), host)
    kv = backend.zeros((2, 3), np.float32)
    backend.begin_step()
    backend.upload(np.ones((2, 3), np.float32))  # a per-step buffer may reuse memory, zeros may not
    np.testing.assert_array_equal(backend.to_host(kv), 0)


@pytest.mark.parametrize("storage_dtype", [np.uint16, np.float32])
def test_ops_return_device_arrays_shaped_as_cpu(rng, storage_dtype):
    cuda_ops, cpu_ops = CudaBackend(), CpuBackend()
    cuda_ops.begin_step()
    x = rng.standard_normal((2, 8), dtype=np.float32)
    w = rng.standard_normal((4, 8), dtype=np.float32).astype(storage_dtype) if storage_dtype != np.uint16 \
        else rng.integers(0x3C00, 0x3F00, (4, 8)).astype(np.uint16)  # modest bf16 values
    got = cuda_ops.linear(cuda_ops.upload(x), cuda_ops.weight(w))
    np.testing.assert_allclose(cuda_ops.to_host(got), cpu_ops.linear(x, cpu_ops.weight(w)), rtol=1e-5)
    ids, weights = cuda_ops.topk_softmax(got, 2, True)
    assert cuda_ops.to_host(ids).shape == (2, 2) and cuda_ops.to_host(weights).dtype == np.float32


VISION_OPS = ["layernorm", "tiled_linear", "activation", "add_bias", "vision_attention", "scatter_rows"]


def test_cuda_backend_offers_the_vision_ops_with_the_same_parameters():
    for name in VISION_OPS:
        cpu = list(inspect.signature(getattr(CpuBackend, name)).parameters)
        cuda = list(inspect.signature(getattr(CudaBackend, name)).parameters)[1:]  # less self
        assert cuda == cpu, name
def test_running_out_of_device_memory_fails_the_step_not_the_worker():
    from numba.cuda.cudadrv.driver import CudaAPIError

    from moebus.cuda.backends import is_fatal_device_error
    from moebus.cuda.memory.ledger import OutOfMemory

    assert not is_fatal_device_error(CudaAPIError(2, "cuMemAlloc: out of memory"))
    assert not is_fatal_device_error(OutOfMemory("emulated GPU full"))
    assert is_fatal_device_error(CudaAPIError(700, "an illegal memory access was encountered"))
    assert not is_fatal_device_error(ValueError("bad request"))


def test_a_capture_refused_falls_back_to_eager_and_other_errors_pass_on():
    from numba.cuda.cudadrv.driver import CudaAPIError

    from moebus.cuda.backends import is_capture_error, is_fatal_device_error, passes_capture
    from moebus.cuda.memory.ledger import OutOfMemory

    implicit = CudaAPIError(906, "cuMemcpyHtoD: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT")
    assert is_capture_error(implicit) and is_fatal_device_error(implicit)  # (outside a capture's own fallback)
    assert not passes_capture(implicit) and not passes_capture(RuntimeError("build process invalidated"))
    assert passes_capture(CudaAPIError(700, "an illegal memory access was encountered"))
    assert passes_capture(OutOfMemory("emulated GPU full")) and passes_capture(CudaAPIError(2, "out of memory"))
    assert not is_capture_error(CudaAPIError(700, "x")) and not is_capture_error(ValueError(906))
