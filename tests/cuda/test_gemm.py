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
from moebus.cuda.kernels.grouped_moe import (ExpertTiles, grouped_ffn_ref, plan_tiles, tile_bound, tile_pairs,
                                             tile_pointers)
from moebus.cuda.kernels.linear import linear_ref
from moebus.cuda.kernels.moe import expert_blob_views
from moebus.cuda.kernels.prefill_attention import masked_softmax_cuda, masked_softmax_ref
from moebus.cuda.kernels.vision_attention import vision_attention_ref
from tests.cuda.conftest import device


@pytest.fixture
def ops():
    """The cuda backend with tensor cores for every row count (HostBlas under the simulator)."""
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


def test_tile_plan_lays_out_tiles_per_expert():
    ids = np.array([[3, 1], [1, 0], [3, 1]], np.int32)
    plan = plan_tiles(ids, parts=2, pairs_per_tile=2)  # expert 1's three pairs take two tiles
    np.testing.assert_array_equal(plan.experts, [0, 1, 3])
    np.testing.assert_array_equal(plan.first_tile, [0, 1, 3, 4])
    # tile j is rows 4 j ... 4 j + 3 (part 0: +0, +1; part 1: +2, +3); pairs 3 | 1, 2, 5 | 0, 4
    np.testing.assert_array_equal(plan.pair_row, [12, 4, 5, 0, 13, 8])
    np.testing.assert_array_equal(plan.tile_fill, [1, 2, 1, 2])
    assert plan.num_tiles == 4 <= tile_bound(6, 3, 2)


def test_tile_bound_covers_any_routing(rng):
    for _ in range(50):
        num_experts, t = int(rng.integers(1, 20)), int(rng.integers(1, 9))
        ids = rng.integers(0, num_experts, (int(rng.integers(1, 60)), 1)).astype(np.int32)
        assert plan_tiles(ids, 2, t).num_tiles <= tile_bound(ids.size, num_experts, t)


def test_tiles_are_about_the_mean_pairs_per_expert():
    assert tile_pairs(2048 * 8, 32) == 64  # the most
    assert tile_pairs(512 * 8, 128) == 32
    assert tile_pairs(100 * 8, 128) == 16  # the least
    assert tile_pairs(3 * 40, 6) == 32  # 20 a expert, rounded up


def _experts(rng, hidden, inter, num_slots):
    arena = f32_to_bf16(rng.standard_normal((num_slots, 3 * inter * hidden), dtype=np.float32) * 0.3)
    weights = [expert_blob_views(arena, slot, hidden, inter) for slot in range(num_slots)]
    return arena, weights


def _routing(rng, num_tokens, top_k, num_experts):
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    ids[: num_tokens * 3 // 4, 0] = 4  # expert 4 gets many tiles, expert 5 none
    ids[:, 1:] = np.where(ids[:, 1:] == 4, 0, ids[:, 1:])
    ids[:, 1] = np.where(ids[:, 2] == ids[:, 1], (ids[:, 2] + 1) % 4, ids[:, 1])
    return ids


def _reference(x, ids, weights, slot_of):
    gate_up = {e: np.concatenate([to_f32(weights[s][0]), to_f32(weights[s][1])]) for e, s in enumerate(slot_of)}
    down = {e: to_f32(weights[s][2]) for e, s in enumerate(slot_of)}
    return grouped_ffn_ref(x, ids, gate_up, down)


@pytest.mark.parametrize("precision", ["split", "bf16"])
def test_expert_tiles_planned_on_the_host_in_groups(ops, rng, precision):
    ops.tensor_cores = TensorCores(ops.tensor_cores.blas, precision=precision, min_rows=1)
    hidden, inter, num_tokens, top_k = 16, 8, 40, 3
    arena, weights = _experts(rng, hidden, inter, 6)
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    ids = _routing(rng, num_tokens, top_k, 6)
    slot_of = np.array([3, 0, 5, 1, 2, 4], np.int32)  # expert -> arena slot
    plan = plan_tiles(ids, ops.tensor_cores.parts, pairs_per_tile=8)
    work = ExpertTiles(ops, ops.tensor_cores, device(x), top_k, plan.num_tiles, hidden, inter, pairs_per_tile=8)
    work.plan_on_host(plan)
    arena_dev = device(arena)
    bases, strides = work.pointer_layout(arena_dev)
    half = len(plan.experts) // 2  # two groups, as a small cache would run them
    for first, end in ((0, half), (half, len(plan.experts))):
        tiles = np.arange(plan.first_tile[first], plan.first_tile[end])
        slots = np.repeat(slot_of[plan.experts[first:end]], np.diff(plan.first_tile)[first:end])
        pointers = device(tile_pointers(bases, strides, tiles, slots))
        work.gate_up(pointers, 0, 1)  # in two calls, as resident and missed experts are
        work.gate_up(pointers, 1)
        work.swiglu(tiles[0], len(tiles))
        work.down(pointers)
    got = ops.to_host(work.pair_outputs())
    tolerance = 1e-4 if precision == "split" else 3e-2
    np.testing.assert_allclose(got, _reference(x, ids, weights, slot_of), rtol=tolerance, atol=tolerance)


def test_expert_tiles_planned_on_the_device(ops, rng):
    hidden, inter, num_tokens, top_k, t = 16, 8, 40, 3, 8
    arena, weights = _experts(rng, hidden, inter, 7)
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    ids = _routing(rng, num_tokens, top_k, 6)
    slot_of = np.array([3, 0, 6, 1, 2, 4], np.int32)
    max_tiles = tile_bound(ids.size, 6, t)
    work = ExpertTiles(ops, ops.tensor_cores, device(x), top_k, max_tiles, hidden, inter, pairs_per_tile=t)
    arena_dev = device(arena)
    pointers = ops.to_host(work.plan_on_device(device(ids), arena_dev, device(slot_of), 6))
    # the tiles' pointers are the host plan's; spare tiles read slot 0's expert into rows of their own
    plan = plan_tiles(ids, ops.tensor_cores.parts, t)
    tile_slots = np.zeros(max_tiles, np.int64)
    tile_slots[: plan.num_tiles] = np.repeat(slot_of[plan.experts], np.diff(plan.first_tile))
    tile_slots[plan.num_tiles :] = slot_of[0]
    np.testing.assert_array_equal(pointers, tile_pointers(*work.pointer_layout(arena_dev), np.arange(max_tiles),
                                                          tile_slots))
    fill = np.zeros(max_tiles, np.int32)
    fill[: plan.num_tiles] = plan.tile_fill
    np.testing.assert_array_equal(ops.to_host(work.tile_fill), fill)
    # each expert's pairs take the rows of its tiles, each row once (their order is the atomics')
    pair_row = ops.to_host(work.pair_row)
    assert len(set(pair_row)) == ids.size
    for g in range(len(plan.experts)):
        mine = plan.pair_row[ids.ravel() == plan.experts[g]]
        np.testing.assert_array_equal(np.sort(pair_row[ids.ravel() == plan.experts[g]]), np.sort(mine))
    work.gate_up(device(pointers))
    work.swiglu(0, max_tiles)
    work.down(device(pointers))
    np.testing.assert_allclose(ops.to_host(work.pair_outputs()), _reference(x, ids, weights, slot_of), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("first_pos, window, causal", [(0, 0, True), (5, 0, True), (5, 4, True), (0, 0, False)])
def test_masked_softmax(ops, rng, first_pos, window, causal):
    scores = rng.standard_normal((2, 3, 9), dtype=np.float32) * 4
    got = device(np.concatenate([scores.ravel(), [7.0]]).astype(np.float32))  # one element past the rows
    masked_softmax_cuda(got, scores.shape, first_pos, window, causal)
    got = got.copy_to_host()
    np.testing.assert_allclose(got[:-1].reshape(scores.shape), masked_softmax_ref(scores, first_pos, window, causal),
                               rtol=1e-5, atol=1e-6)
    assert got[-1] == 7.0


@pytest.mark.parametrize("first_pos, window, causal", [(70, 0, True), (70, 33, True), (0, 0, False)])
def test_masked_softmax_rows_longer_than_a_warp_at_a_pitch(ops, rng, first_pos, window, causal):
    # 75 keys a row (2+ lanes' strides), rows 80 apart, more rows than one block's warps
    batch, queries, keys, pitch = 2, 5, 75, 80
    scores = rng.standard_normal((batch, queries, pitch), dtype=np.float32) * 6
    got = device(scores.ravel().copy())
    masked_softmax_cuda(got, (batch, queries, keys), first_pos, window, causal, pitch=pitch)
    got = got.copy_to_host().reshape(batch, queries, pitch)
    np.testing.assert_allclose(got[..., :keys], masked_softmax_ref(scores[..., :keys], first_pos, window, causal),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(got[..., keys:], scores[..., keys:])  # the pitch's padding is not touched


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


def test_expert_tiles_read_the_placement_table(ops, rng):
    """Decode's plan: an expert has an arena slot or (a negative entry, -1 - row) a host-store row;
    spare tiles read the first expert that has a slot."""
    hidden, inter, num_tokens, top_k, t = 16, 8, 40, 3, 16
    arena, weights = _experts(rng, hidden, inter, 4)
    store, store_weights = _experts(rng, hidden, inter, 12)
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    ids = _routing(rng, num_tokens, top_k, 6)
    entries = np.array([-1 - 7, 2, -1 - 0, 0, 3, -1 - 11], np.int32)  # expert -> slot, or -1 - store row
    max_tiles = tile_bound(ids.size, 6, t)
    work = ExpertTiles(ops, ops.tensor_cores, device(x), top_k, max_tiles, hidden, inter, pairs_per_tile=t)
    arena_dev, store_dev = device(arena), device(store)
    pointers = ops.to_host(work.plan_on_device(device(ids), arena_dev, device(entries), 6, store=store_dev))
    plan = plan_tiles(ids, ops.tensor_cores.parts, t)
    assert plan.num_tiles < max_tiles  # spare tiles to check
    tile_entry = np.full(max_tiles, entries[1])  # expert 1: the first with a slot
    tile_entry[: plan.num_tiles] = np.repeat(entries[plan.experts], np.diff(plan.first_tile))
    in_arena = tile_pointers(*work.pointer_layout(arena_dev), np.arange(max_tiles), np.maximum(tile_entry, 0))
    in_store = tile_pointers(*work.pointer_layout(store_dev), np.arange(max_tiles), np.maximum(-1 - tile_entry, 0))
    np.testing.assert_array_equal(pointers[1:3], in_arena[1:3])  # the rows: this layer's own
    for c in (0, 3):
        np.testing.assert_array_equal(pointers[c], np.where(tile_entry >= 0, in_arena[c], in_store[c]))
    work.gate_up(device(pointers))
    work.swiglu(0, max_tiles)
    work.down(device(pointers))
    placed = [weights[e] if e >= 0 else store_weights[-1 - e] for e in entries]
    np.testing.assert_allclose(ops.to_host(work.pair_outputs()), _reference(x, ids, placed, range(6)), rtol=1e-4,
                               atol=1e-4)


def test_spare_tiles_read_the_last_real_tile_where_no_expert_has_a_slot(ops, rng):
    hidden, inter, top_k, t = 16, 8, 2, 16
    ids = np.array([[0, 1], [1, 2], [0, 2]], np.int32)  # expert 3 unchosen: 3 tiles of a bound of 4
    store, _ = _experts(rng, hidden, inter, 4)
    work = ExpertTiles(ops, ops.tensor_cores, device(rng.standard_normal((3, hidden), dtype=np.float32)), top_k,
                       tile_bound(ids.size, 4, t), hidden, inter, pairs_per_tile=t)
    assert work.max_tiles == 4
    arena_dev, store_dev = device(np.zeros((1, store.shape[1]), np.uint16)), device(store)
    entries = device(np.array([-1, -2, -3, -4], np.int32))  # every expert in the host store
    pointers = ops.to_host(work.plan_on_device(device(ids), arena_dev, entries, 4, store=store_dev))
    want = tile_pointers(*work.pointer_layout(store_dev), np.arange(4), np.array([0, 1, 2, 2]))
    np.testing.assert_array_equal(pointers[[0, 3]], want[[0, 3]])


def test_a_slow_cublas_call_is_logged_with_its_shape(monkeypatch, caplog):
    """gemm_host._Cublas logs a call whose host time passes SLOW_CALL_S (a kernel's first load under
    CUDA's lazy loading), its shape in the line; a threshold of 0 logs none."""
    import logging

    from moebus.cuda.kernels import gemm_host

    class Binding:  # nvmath.bindings.cublas as _Cublas calls it
        def create(self):
            return 1

        def set_stream(self, handle, stream):
            pass

        def set_workspace(self, handle, address, size):
            pass

        def gemm_batched_ex(self, *args):
            pass

        def gemm_ex(self, *args):
            pass
    blas = gemm_host._Cublas(Binding())
    monkeypatch.setattr(gemm_host, "SLOW_CALL_S", 1e-12)
    with caplog.at_level(logging.INFO, logger="moebus.cublas"):
        blas.gemm_batched(0, 1, 0, 1536, 64, 2048, 0, 0, 2048, 0, 0, 2048, 0, 1536, batch=7)
        blas.gemm(0, 1, 0, 8, 4, 16, 0, 0, 16, 0, 0, 16, 0, 8)
    assert blas.slow_calls == 2
    assert "cuBLAS gemm_batched m 1536 n 64 k 2048 batch 7 took" in caplog.records[0].getMessage()
    assert "cuBLAS gemm m 8 n 4 k 16 batch 1 took" in caplog.records[1].getMessage()
    monkeypatch.setattr(gemm_host, "SLOW_CALL_S", 0.0)  # 0: none logged
    blas.gemm(0, 1, 0, 8, 4, 16, 0, 0, 16, 0, 0, 16, 0, 8)
    assert blas.slow_calls == 2


def test_a_cublas_handle_keeps_its_own_workspace_after_every_set_stream(monkeypatch):
    """gemm_host._Cublas gives the handle it makes a WORKSPACE_BYTES workspace of its own (cuBLAS would
    otherwise take one with cudaMallocAsync inside a graph capture: alloc nodes, which the driver's edge
    edits refuse: pdl.py), made once, and set again after every set_stream (cublasSetStream resets the
    handle to cuBLAS's own pool); 0 leaves cuBLAS its own."""
    from moebus.cuda.kernels import gemm_host

    calls = []

    class Binding:
        def create(self):
            return 7

        def set_stream(self, handle, stream):
            calls.append(("stream", handle, stream))

        def set_workspace(self, handle, address, size):
            calls.append(("workspace", handle, address, size))

        def gemm_ex(self, *args):
            pass
    monkeypatch.setattr(gemm_host, "WORKSPACE_BYTES", 1 << 12)
    blas = gemm_host._Cublas(Binding())
    for stream in (0, 0, 5):
        blas.gemm(stream, 1, 0, 8, 4, 16, 0, 0, 16, 0, 0, 16, 0, 8)
    workspace = ("workspace", 7, gemm_host.address(blas.workspace), 1 << 12)
    assert calls == [("stream", 7, 0), workspace, ("stream", 7, 0), workspace, ("stream", 7, 5), workspace]
    assert workspace[2] != 0 and blas.workspace.nbytes == 1 << 12
    monkeypatch.setattr(gemm_host, "WORKSPACE_BYTES", 0)
    calls.clear()
    gemm_host._Cublas(Binding()).gemm(0, 1, 0, 8, 4, 16, 0, 0, 16, 0, 0, 16, 0, 8)
    assert calls == [("stream", 7, 0)]
