"""A long step through the tensor-core path (dense products, experts grouped by expert, attention
over query blocks) against the cpu device, on a micro model: the threshold is lowered so that a few
tokens count as "long"; in the simulator HostBlas stands in for cuBLAS (test_gemm.py), on a GPU
(MOEBUS_TEST_GPU=1) cuBLAS itself runs."""
import numpy as np
import pytest
from moebus.cuda.kernels.gemm import TensorCores
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.workers import stage
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel
from tests.cuda.test_e2e import micro_model  # noqa: F401 - the fixture

BATCH = StepBatch(slots=[0, 1], starts=[0, 0], lengths=[5, 4], tokens=[5, 17, 42, 9, 77, 3, 8, 120, 64])


class CountingBlas:
    """Counts the products of the blas it wraps (HostBlas on host addresses, cuBLAS on a GPU's)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def gemm(self, *args, **kwargs):
        self.calls += 1
        return self.inner.gemm(*args, **kwargs)

    def gemm_batched(self, *args, **kwargs):
        self.calls += 1
        return self.inner.gemm_batched(*args, **kwargs)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])  # bf16: attention reads the cache's rows directly
def test_prefill_then_decode_match_the_cpu_device(micro_model, monkeypatch, kv_dtype):  # noqa: F811
    monkeypatch.setattr(stage, "ROUTED_MAX_TOKENS", 2)
    cpu = LocalModel(micro_model, device="cpu", max_context=32, kv_dtype=kv_dtype)
    cuda = LocalModel(micro_model, device="cuda", max_context=32, kv_dtype=kv_dtype)
    blas = CountingBlas(HostBlas() if SIMULATOR else cublas_blas())
    cuda.backend.tensor_cores = TensorCores(blas, min_rows=3)
    want, got = cpu.step(BATCH, want_logits=True), cuda.step(BATCH, want_logits=True)
    cfg = cuda.ckpt.config
    # per layer: q, k, v or qkv, o, router (split: 2 calls each), attention (2 per kv head and sequence), experts
    assert blas.calls > cfg.num_layers * 8
    calls = blas.calls
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-3)
    assert blas.calls == calls
    follow = StepBatch(slots=[0, 1], starts=[5, 4], lengths=[1, 1], tokens=list(want.tokens))
    want, got = cpu.step(follow, want_logits=True), cuda.step(follow, want_logits=True)  # decode: GEMVs, routed
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-3)
    assert blas.calls == calls
