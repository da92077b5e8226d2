"""Tensor-core products (gemm.py, grouped_moe.py, prefill_attention.py) against their numpy
references. Under the simulator the cuBLAS calls run on HostBlas (numpy over the same addresses,
leading dimensions and strides), so the layouts are what is checked here; the GPU run
(MOEBUS_TEST_GPU=1) checks cuBLAS itself."""
import logging
import sys

import numpy as np
import pytest

from moebus.cuda.backends.cuda import CudaBackend
from moebus.cuda.dtypes import bf16_to_f32, f32_to_bf16, to_f32
from moebus.cuda.kernels import gemm
from moebus.cuda.kernels.attention import attention_ref
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import TensorCores, gemm_linear_ref, split_bf16_ref
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.cuda.kernels.grouped_moe import ROW_ALIGN, GroupedExperts, block_rows, grouped_ffn_ref, plan_pairs
from moebus.cuda.kernels.linear import linear_ref
from moebus.cuda.kernels.moe import expert_blob_views
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


def test_pair_plan_lays_out_padded_blocks_per_expert():
    ids = np.array([[3, 1], [1, 0], [3, 1]], np.int32)
    plan = plan_pairs(ids, parts=2)
    np.testing.assert_array_equal(plan.experts, [0, 1, 3])
    np.testing.assert_array_equal(plan.counts, [1, 3, 2])
    np.testing.assert_array_equal(plan.caps, [ROW_ALIGN] * 3)
    np.testing.assert_array_equal(plan.bases, [0, 2 * ROW_ALIGN, 4 * ROW_ALIGN])
    np.testing.assert_array_equal(plan.sorted_token, [1, 0, 1, 2, 0, 2])  # pairs 3 | 1, 2, 5 | 0, 4
    np.testing.assert_array_equal(plan.pair_row, [4 * ROW_ALIGN, 2 * ROW_ALIGN, 2 * ROW_ALIGN + 1, 0,
                                                  4 * ROW_ALIGN + 1, 2 * ROW_ALIGN + 2])
    assert plan.num_rows == 6 * ROW_ALIGN


def test_block_rows_pad_under_a_quarter_in_few_sizes():
    counts = np.arange(1, 5000)
    caps = block_rows(counts)
    assert (caps >= counts).all() and (caps % ROW_ALIGN == 0).all()
    assert ((caps - counts)[counts > 4 * ROW_ALIGN] < counts[counts > 4 * ROW_ALIGN] / 4).all()
    assert len(np.unique(block_rows(np.arange(400, 700)))) <= 4  # 2048 tokens x 8 of 32 experts: ~512 each


@pytest.mark.parametrize("precision", ["split", "bf16"])
def test_grouped_experts_match_the_reference(ops, rng, precision):
    ops.tensor_cores = TensorCores(ops.tensor_cores.blas, precision=precision, min_rows=1)
    hidden, inter, num_tokens, top_k, num_slots = 16, 8, 40, 3, 6
    arena = f32_to_bf16(rng.standard_normal((num_slots, 3 * inter * hidden), dtype=np.float32) * 0.3)
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    ids = np.stack([rng.choice(5, top_k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    ids[:30, 0] = 4  # expert 4 gets more than ROW_ALIGN pairs: caps differ, two batched calls
    ids[:30, 1:] = np.where(ids[:30, 1:] == 4, 0, ids[:30, 1:])
    ids[:30, 1] = np.where(ids[:30, 2] == ids[:30, 1], (ids[:30, 2] + 1) % 4, ids[:30, 1])
    slot_of = np.array([3, 0, 5, 1, 2], np.int32)  # expert -> arena slot
    plan = plan_pairs(ids, ops.tensor_cores.parts)
    assert len(set(plan.caps)) == 2
    work = GroupedExperts(ops, ops.tensor_cores, device(x), plan, hidden, inter)
    arena_dev = device(arena)
    half = len(plan.experts) // 2  # two groups, as a small cache would run them
    for picked in (np.arange(half), np.arange(half, len(plan.experts))):
        work.gate_up(arena_dev, slot_of[plan.experts[picked]], picked)
        work.down(arena_dev, slot_of[plan.experts[picked]], picked)
    got = ops.to_host(work.pair_outputs())
    weights = [expert_blob_views(arena, slot, hidden, inter) for slot in slot_of]
    gate_up = {e: np.concatenate([to_f32(w[0]), to_f32(w[1])]) for e, w in enumerate(weights)}
    down = {e: to_f32(w[2]) for e, w in enumerate(weights)}
    tolerance = 1e-4 if precision == "split" else 3e-2
    np.testing.assert_allclose(got, grouped_ffn_ref(x, ids, gate_up, down), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("first_pos, window, causal", [(0, 0, True), (5, 0, True), (5, 4, True), (0, 0, False)])
def test_masked_softmax(ops, rng, first_pos, window, causal):
    scores = rng.standard_normal((2, 3, 9), dtype=np.float32) * 4
    got = device(np.concatenate([scores.ravel(), [7.0]]).astype(np.float32))  # one element past the rows
    masked_softmax_cuda(got, scores.shape, first_pos, window, causal)
    got = got.copy_to_host()
    np.testing.assert_allclose(got[:-1].reshape(scores.shape), masked_softmax_ref(scores, first_pos, window, causal),
                               rtol=1e-5, atol=1e-6)
    assert got[-1] == 7.0


def test_masked_softmax_split_copies(ops, rng):
    scores = rng.standard_normal((2, 3, 9), dtype=np.float32) * 4
    out3 = device(np.zeros(2 * 3 * 27, np.uint16))
    masked_softmax_cuda(device(scores.ravel()), scores.shape, 4, 0, True, out=out3)
    copies = bf16_to_f32(out3.copy_to_host().reshape(2, 3, 9, 3))
    want = masked_softmax_ref(scores, 4, 0, True)
    np.testing.assert_array_equal(copies[..., 0], copies[..., 1])  # hi, hi, lo
    np.testing.assert_allclose(copies[..., 0], want, rtol=2 ** -8)
    np.testing.assert_allclose(copies[..., 0] + copies[..., 2], want, rtol=2e-5, atol=1e-7)


def test_masked_softmax_split_planes(ops, rng):
    # the parts against a bf16 cache: every hi part, then every lo part
    scores = rng.standard_normal((2, 3, 9), dtype=np.float32) * 4
    out = device(np.zeros(2 * 2 * 3 * 9, np.uint16))
    masked_softmax_cuda(device(scores.ravel()), scores.shape, 4, 0, True, out=out, copies=2)
    hi, lo = bf16_to_f32(out.copy_to_host().reshape(2, 2, 3, 9))
    want = masked_softmax_ref(scores, 4, 0, True)
    np.testing.assert_allclose(hi, want, rtol=2 ** -8)
    np.testing.assert_allclose(hi + lo, want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("precision, kv_dtype", [("split", "fp32"), ("f32", "fp32"), ("split", "bf16")])
@pytest.mark.parametrize("window", [0, 5])
def test_prefill_attention_reads_the_earlier_context(ops, rng, window, precision, kv_dtype, monkeypatch):
    from moebus.cuda.kernels import prefill_attention

    monkeypatch.setattr(prefill_attention, "PRECISION", precision)
    monkeypatch.setattr(prefill_attention, "MAX_SCORE_BYTES", 2 * 9 * 4 * 10)  # query blocks of at most 4 rows
    heads, kv_heads, hd, context = 4, 2, 8, 16
    k_cache = rng.standard_normal((3, kv_heads, context, hd), dtype=np.float32)
    v_cache = rng.standard_normal((3, kv_heads, context, hd), dtype=np.float32)
    if kv_dtype == "bf16":  # the keys and values as a bf16 cache holds them
        k_cache, v_cache = f32_to_bf16(k_cache), f32_to_bf16(v_cache)
    segments = [(0, 2, 3, 6), (6, 0, 0, 5)]  # (first row, slot, start, length): slot 2 has 3 earlier keys
    token_slot = np.array([2] * 6 + [0] * 5, np.int32)
    token_pos = np.array(list(range(3, 9)) + list(range(5)), np.int32)
    q = rng.standard_normal((11, heads, hd), dtype=np.float32)
    got = ops.to_host(ops.attention(device(q), device(k_cache), device(v_cache), device(token_slot), device(token_pos),
                                    hd ** -0.5, window, segments=segments))
    ref = attention_ref(q, k_cache, v_cache, token_slot, token_pos, hd ** -0.5, window)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["split", "f32"])
def test_image_attention(ops, rng, precision, monkeypatch):
    from moebus.cuda.kernels import prefill_attention

    monkeypatch.setattr(prefill_attention, "PRECISION", precision)
    monkeypatch.setattr(prefill_attention, "MAX_SCORE_BYTES", 3 * 5 * 2 * 10)  # query blocks of 2 rows
    q, k, v = (rng.standard_normal((2 * 5, 3, 8), dtype=np.float32) for _ in range(3))
    got = ops.to_host(ops.vision_attention(device(q), device(k), device(v), 2, 8 ** -0.5))
    np.testing.assert_allclose(got, vision_attention_ref(q, k, v, 2, 8 ** -0.5), rtol=1e-4, atol=1e-5)
