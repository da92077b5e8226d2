"""A long step through the tensor-core path (dense products, experts grouped by expert, attention
over query blocks) against the cpu device, on a micro model: the threshold is lowered so that a few
tokens count as "long"; in the simulator HostBlas stands in for cuBLAS (test_gemm.py), on a GPU
(MOEBUS_TEST_GPU=1) cuBLAS itself runs."""
import numpy as np
import pytest
from moebus.cuda.kernels.gemm import TensorCores
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.workers import moe_prefill, stage
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


@pytest.mark.parametrize("plan,kv_dtype", [("device", "fp32"), ("host", "bf16")])
def test_prefill_then_decode_match_the_cpu_device(micro_model, monkeypatch, plan, kv_dtype):  # noqa: F811
    """plan: the experts' tiles planned by a kernel or on the host; kv_dtype bf16: attention reads the
    cache's rows directly. (Each plan and each cache dtype once: the plan is the experts' and the
    dtype the attention's, apart in the step.)"""
    monkeypatch.setattr(stage, "ROUTED_MAX_TOKENS", 2)
    monkeypatch.setattr(moe_prefill, "PLAN", plan)
    planned = []
    for where in ("device", "host"):
        inner = getattr(moe_prefill, f"_planned_on_{where}")
        monkeypatch.setattr(moe_prefill, f"_planned_on_{where}",
                            lambda *a, inner=inner, where=where: planned.append(where) or inner(*a))
    cpu = LocalModel(micro_model, device="cpu", max_context=32, kv_dtype=kv_dtype)
    cuda = LocalModel(micro_model, device="cuda", max_context=32, kv_dtype=kv_dtype)
    blas = CountingBlas(HostBlas() if SIMULATOR else cublas_blas())
    cuda.backend.tensor_cores = TensorCores(blas, min_rows=3)
    want, got = cpu.step(BATCH, want_logits=True), cuda.step(BATCH, want_logits=True)
    cfg = cuda.ckpt.config
    assert planned and set(planned) == {plan}
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


def test_the_device_plans_where_the_cache_holds_the_layer_and_most_experts_are_chosen(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(moe_prefill, "PLAN", "auto")
    whole, small = SimpleNamespace(num_slots=128), SimpleNamespace(num_slots=100)
    assert moe_prefill.plans_on_device(whole, 512, 128)  # 4 pairs per expert
    assert not moe_prefill.plans_on_device(whole, 511, 128)  # a short step: only the chosen experts are copied in
    assert not moe_prefill.plans_on_device(small, 16384, 128)  # acquired in groups
    assert not moe_prefill.plans_on_device(SimpleNamespace(num_slots=4096), 1 << 20, 1024)  # past the counters


def test_a_decode_step_of_many_sequences_groups_its_experts_and_matches_the_cpu_device(micro_model,
                                                                                       monkeypatch):  # noqa: F811
    """Decode (routed, a captured graph on a GPU) with enough pairs per expert: the experts in tiles on
    tensor cores, read where the placement table says (host-store rows: test_gemm.py; the micro
    model's experts fit one 2 MiB granule, so every expert is resident here)."""
    monkeypatch.setattr(stage, "ROUTED_MAX_TOKENS", 8)
    monkeypatch.setattr(moe_prefill, "DECODE_PAIRS_PER_EXPERT", 2)  # 4 tokens x 2 of 4 experts: 2 each
    placed = []
    inner = moe_prefill.grouped_moe_placed
    monkeypatch.setattr(stage, "grouped_moe_placed", lambda *a: placed.append(1) or inner(*a))
    cpu = LocalModel(micro_model, device="cpu", max_context=32)
    cuda = LocalModel(micro_model, device="cuda", max_context=32, prefetch_slots=0)
    cuda.backend.tensor_cores = TensorCores(HostBlas() if SIMULATOR else cublas_blas(), min_rows=3)
    prompts = StepBatch(slots=[0, 1, 2, 3], starts=[0] * 4, lengths=[5, 4, 3, 3], tokens=list(range(20, 35)))
    want, got = cpu.step(prompts), cuda.step(prompts)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert not placed  # a prefill step: grouped_moe
    for n in range(3):
        step = StepBatch(slots=[0, 1, 2, 3], starts=[5 + n, 4 + n, 3 + n, 3 + n], lengths=[1] * 4,
                         tokens=list(want.tokens))
        want, got = cpu.step(step, want_logits=True), cuda.step(step, want_logits=True)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-3)
    # on a GPU: the capture runs the step twice in Python (a warm-up, then the capture), replays none
    steps_run_in_python = 2 if cuda.stages[0].use_graphs else 3
    assert len(placed) == steps_run_in_python * cuda.ckpt.config.num_layers


def test_decode_tiles_need_tensor_cores_bf16_experts_and_enough_pairs_per_expert(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(moe_prefill, "DECODE_PAIRS_PER_EXPERT", 8)
    ops = SimpleNamespace(tensor_cores=TensorCores(HostBlas()))
    bf16 = SimpleNamespace(array=np.zeros((1, 4), np.uint16), store=SimpleNamespace(layout=None))
    assert moe_prefill.groups_in_decode(ops, bf16, 64 * 8, 32)  # batch 64 over 32 experts: 16 pairs each
    assert not moe_prefill.groups_in_decode(ops, bf16, 16 * 8, 32)  # 4 each: the GEMVs
    assert not moe_prefill.groups_in_decode(ops, bf16, 64 * 8, 128)  # A3B's 128 experts: 4 each
    assert not moe_prefill.groups_in_decode(SimpleNamespace(tensor_cores=None), bf16, 64 * 8, 32)
    quantized = SimpleNamespace(array=np.zeros((1, 4), np.uint8), store=SimpleNamespace(layout=object()))
    assert not moe_prefill.groups_in_decode(ops, quantized, 64 * 8, 32)
    monkeypatch.setattr(moe_prefill, "DECODE_PAIRS_PER_EXPERT", 0)  # MOEBUS_DECODE_GROUPED_PAIRS_PER_EXPERT=0: never
    assert not moe_prefill.groups_in_decode(ops, bf16, 64 * 8, 32)
