"""Device backends: the ops that a stage calls, on numpy (``cpu``) or numba.cuda (``cuda``).

Both take and return their own array type (numpy arrays / device arrays); the stage only moves data
across with ``upload`` / ``persist`` and ``to_host``. Every op's result is per-step scratch: valid
until the next ``begin_step()``, so a backend can recycle buffers instead of allocating per call. Weights are prepared once at load with ``weight``; the
``cpu`` backend keeps dense weights as float32 copies (numpy has no bf16 matmul, and converting per
call would dominate a CPU decode step) while experts stay in their stored dtype in the arena."""
from __future__ import annotations

import numpy as np

from moebus.cuda import attention, elementwise, embedding, linear, moe, rmsnorm, rope, sampling
from moebus.cuda.dtypes import to_f32
from moebus.cuda import activations, layernorm, scatter, tiled_linear, vision_attention  # the vision tower's ops


class CpuBackend:
    """The numpy reference of every op, as the ``cpu`` device."""

    name = "cpu"

    def begin_step(self) -> None:
        """Start of a forward pass: per-step buffers of the previous step may be reused."""

    def weight(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(to_f32(array))

    def table(self, array: np.ndarray) -> np.ndarray:
        """A weight read by row (embedding), kept in its stored dtype."""
        return np.asarray(array)

    def persist(self, array: np.ndarray) -> np.ndarray:
        """A device copy that lives as long as its owner (rope tables, an arena)."""
        return np.ascontiguousarray(array)

    def upload(self, array: np.ndarray) -> np.ndarray:
        """A per-step input, valid until the next begin_step()."""
        return np.ascontiguousarray(array)

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        """A persistent zeroed buffer (KV cache)."""
        return np.zeros(shape, dtype=dtype)

    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        """Per-step scratch, valid until the next begin_step()."""
        return np.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        pass

    def borrow(self, region) -> None:
        """Scratch from lent arena memory: activations are host memory here, so nothing to do."""

    def end_borrow(self) -> None:
        pass

    embedding = staticmethod(embedding.embedding_ref)
    rmsnorm = staticmethod(rmsnorm.rmsnorm_ref)
    linear = staticmethod(linear.linear_ref)
    add = staticmethod(elementwise.add_ref)
    swiglu = staticmethod(elementwise.swiglu_ref)
    rope = staticmethod(rope.rope_ref)
    kv_store = staticmethod(attention.kv_store_ref)
    attention = staticmethod(attention.attention_ref)
    topk_softmax = staticmethod(moe.topk_softmax_ref)
    expert_ffn = staticmethod(moe.expert_ffn_ref)
    combine = staticmethod(moe.combine_ref)
    sample = staticmethod(sampling.sample_ref)
    # vision tower and stage-0 image embeddings
    layernorm = staticmethod(layernorm.layernorm_ref)
    tiled_linear = staticmethod(tiled_linear.tiled_linear_ref)
    activation = staticmethod(activations.activation_ref)
    add_bias = staticmethod(activations.add_bias_ref)
    vision_attention = staticmethod(vision_attention.vision_attention_ref)
    scatter_rows = staticmethod(scatter.scatter_rows_ref)


def make_backend(device: str):
    """'cpu' or 'cuda'. (The op files hold kernels beside their references, so numba is imported
    either way; only the cuda backend creates a CUDA context.)"""
    if device == "cpu":
        return CpuBackend()
    if device == "cuda":
        from moebus.cuda.backend_cuda import CudaBackend

        return CudaBackend()
    raise ValueError(f"unknown device {device!r}")


def is_fatal_device_error(exc: BaseException) -> bool:
    """True for errors after which the device (CUDA context) cannot be trusted any more."""
    if isinstance(exc, MemoryError):
        return True
    module = type(exc).__module__ or ""
    return module.startswith("numba.cuda.cudadrv") or module.startswith("numba_cuda") or \
        type(exc).__name__ in ("CudaAPIError", "CudaSupportError", "CudaDriverError")
