"""Tensor-core products (gemm.py, grouped_moe.py, prefill_attention.py) against their numpy
references. Under the simulator the cuBLAS calls run on HostBlas (numpy over the same addresses,
leading dimensions and strides), so the layouts are what is checked here; the GPU run
(MOEBUS_TEST_GPU=1) checks cuBLAS itself."""
import logging
import sys

import numpy as np
import pytest

from moebus.cuda.backends.cuda import CudaBackend
from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels import gemm
from moebus.cuda.kernels.attention import attention_ref
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import TensorCores, gemm_linear_ref, split_bf16_ref
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.cuda.kernels.grouped_moe import GroupedExperts, plan_pairs, swiglu_split_cuda, swiglu_split_ref
from moebus.cuda.kernels.linear import linear_ref
from moebus.cuda.kernels.moe import expert_ffn_ref
from moebus.cuda.kernels.prefill_attention import masked_softmax_cuda, masked_softmax_ref
from moebus.cuda.kernels.vision_attention import vision_attention_ref
from tests.cuda.conftest import device


@pytest.fixture
def ops():
    backend = CudaBackend()
    backend.tensor_cores = TensorCores(HostBlas() if SIMULATOR else cublas_blas(), min_rows=1)
    backend.begin_step()
    return backend


def test_split_is_hi_and_lo_bf16_parts(ops, rng):
    x = rng.standard_normal((5, 12), dtype=np.float32) * 3
    x[0, 0], x[0, 1] = 1.0 + 2.0 ** -8, -0.0  # a tie that rounds to even, and a signed zero
    parts = ops.to_host(ops.tensor_cores.split(ops, device(x)))
    np.testing.assert_array_equal(parts, split_bf16_ref(x))
    rows = np.array([4, 0, 4], np.int32)
    gathered = ops.to_host(ops.tensor_cores.split(ops, device(x), rows=device(rows)))
    np.testing.assert_array_equal(gathered, split_bf16_ref(x[rows]))


@pytest.mark.parametrize("precision, rtol", [("split", 2e-4), ("bf16", 3e-2)])
def test_linear_on_tensor_cores(ops, rng, precision, rtol):
    ops.tensor_cores = TensorCores(ops.tensor_cores.blas, precision=precision, min_rows=1)
    x = rng.standard_normal((7, 24), dtype=np.float32)
    w = f32_to_bf16(rng.standard_normal((9, 24), dtype=np.float32))
    out = ops.to_host(ops.linear(device(x), device(w)))
    parts = gemm.PARTS[precision]
    np.testing.assert_allclose(out, gemm_linear_ref(x, w, parts), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, linear_ref(x, w), rtol=rtol, atol=rtol)


def test_tiled_linear_adds_its_bias(ops, rng):
    x = rng.standard_normal((6, 16), dtype=np.float32)
    w = f32_to_bf16(rng.standard_normal((5, 16), dtype=np.float32))
    bias = f32_to_bf16(rng.standard_normal(5, dtype=np.float32))
    out = ops.to_host(ops.tiled_linear(device(x), device(w), device(bias)))
    np.testing.assert_allclose(out, linear_ref(x, w) + linear_ref(np.ones((1, 1), np.float32), bias[:, None]).ravel(),
                               rtol=1e-4, atol=1e-4)


def test_rows_below_the_threshold_and_other_dtypes_keep_the_gemv(rng):
    tc = TensorCores(HostBlas(), min_rows=65)
    w16 = np.zeros((4, 8), np.uint16)
    assert not tc.wants(64, w16) and tc.wants(65, w16)
    assert not tc.wants(100, np.zeros((4, 8), np.float32)) and not tc.wants(100, np.zeros((4, 8), np.float16))
    with pytest.raises(ValueError, match="precision"):
        TensorCores(HostBlas(), precision="fp8")


def test_missing_nvmath_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(gemm, "SIMULATOR", False)
    for name in ("nvmath", "nvmath.bindings", "nvmath.bindings.cublas"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    with caplog.at_level(logging.WARNING, logger="moebus.cuda"):
        assert gemm.make_tensor_cores() is None
    assert "nvmath-python is not installed" in caplog.text


def test_swiglu_split_over_a_row_range(ops, rng):
    gate_up = rng.standard_normal((6, 8), dtype=np.float32)
    out = device(np.zeros((2, 6, 4), np.uint16))
    swiglu_split_cuda(device(gate_up), 2, 3, out)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[:, 2:5], swiglu_split_ref(gate_up[2:5], 2))
    assert not got[:, :2].any() and not got[:, 5:].any()


def test_grouped_experts_match_the_expert_reference(ops, rng):
    hidden, inter, num_tokens, top_k, num_slots = 16, 8, 9, 3, 6
    arena = f32_to_bf16(rng.standard_normal((num_slots, 3 * inter * hidden), dtype=np.float32) * 0.3)
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    ids = np.stack([rng.choice(5, top_k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    slot_of = np.array([3, 0, 5, 1, 2], np.int32)  # expert -> arena slot
    plan = plan_pairs(ids)
    work = GroupedExperts(ops, ops.tensor_cores, device(x), plan, hidden, inter)
    arena_dev = device(arena)
    half = len(plan.experts) // 2  # two groups, as a small cache would run them
    for chosen in (slice(0, half), slice(half, None)):
        args = slot_of[plan.experts[chosen]], plan.starts[chosen], plan.counts[chosen]
        work.gate_up(arena_dev, *args)
        work.down(arena_dev, *args)
    got = ops.to_host(work.pair_outputs(plan))
    pairs = np.arange(num_tokens * top_k, dtype=np.int32)
    ref = expert_ffn_ref(x, pairs // top_k, slot_of[ids.ravel()], pairs, arena, hidden, inter,
                         np.zeros((len(pairs), hidden), np.float32))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("first_pos, window, causal", [(0, 0, True), (5, 0, True), (5, 4, True), (0, 0, False)])
def test_masked_softmax(ops, rng, first_pos, window, causal):
    scores = rng.standard_normal((2, 3, 9), dtype=np.float32) * 4
    got = device(scores.copy())
    masked_softmax_cuda(got, first_pos, window, causal)
    np.testing.assert_allclose(got.copy_to_host(), masked_softmax_ref(scores, first_pos, window, causal), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("window", [0, 5])
def test_prefill_attention_reads_the_earlier_context(ops, rng, window, monkeypatch):
    from moebus.cuda.kernels import prefill_attention

    monkeypatch.setattr(prefill_attention, "MAX_SCORE_BYTES", 2 * 9 * 4 * 4)  # query blocks of 4 rows
    heads, kv_heads, hd, context = 4, 2, 8, 16
    k_cache = rng.standard_normal((3, kv_heads, context, hd), dtype=np.float32)
    v_cache = rng.standard_normal((3, kv_heads, context, hd), dtype=np.float32)
    segments = [(0, 2, 3, 6), (6, 0, 0, 5)]  # (first row, slot, start, length): slot 2 has 3 earlier keys
    token_slot = np.array([2] * 6 + [0] * 5, np.int32)
    token_pos = np.array(list(range(3, 9)) + list(range(5)), np.int32)
    q = rng.standard_normal((11, heads, hd), dtype=np.float32)
    got = ops.to_host(ops.attention(device(q), device(k_cache), device(v_cache), device(token_slot), device(token_pos),
                                    hd ** -0.5, window, segments=segments))
    ref = attention_ref(q, k_cache, v_cache, token_slot, token_pos, hd ** -0.5, window)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_image_attention(ops, rng):
    q, k, v = (rng.standard_normal((2 * 5, 3, 8), dtype=np.float32) for _ in range(3))
    got = ops.to_host(ops.vision_attention(device(q), device(k), device(v), 2, 8 ** -0.5))
    np.testing.assert_allclose(got, vision_attention_ref(q, k, v, 2, 8 ** -0.5), rtol=1e-4, atol=1e-5)
