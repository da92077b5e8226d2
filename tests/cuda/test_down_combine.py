"""The routed decode's down GEMV ending in the MoE's combine and the residual add, and the next FP8 projection
normalizing its x from the tiles' squares (moe_quant_mma.COMBINE: moe_quant_mma.cu's COMBINE and NORMED entries, in
place of fused.combine_add_rmsnorm's kernel): compiled by NVRTC for sm_90 without spills and waiting first; the
options they refuse; the switch; the numpy arithmetic against the combine and the norm as the model computes them;
on a GPU each entry against its arithmetic and against the launches it replaces, with host-store misses, early and
not; and a decode through the fused path giving the greedy tokens of the plain one."""
import numpy as np
import pytest

from moebus.common.fp8_dense import fp8_rows
from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.dtypes import to_f32 as stored_f32
from moebus.cuda.kernels import linear_quant_mma, moe_quant_mma, moe_quant_mma_ref
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.fused import combine_add_rmsnorm_ref
from moebus.cuda.kernels.rmsnorm import rmsnorm_ref
from tests.cuda.conftest import device, poisoned, stored
from tests.cuda.test_linear_quant import _weight
from tests.cuda.test_moe_quant import _arena
from tests.cuda.test_moe_quant_mma import _nvrtc, assert_waits_first, spill_stores

A3B = (2048, 768)  # (hidden, intermediate)


def _compile(fmt, cols, rows, shape, early=False, target="cubin", combine=0, normed=False):
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    arch = "sm_90" if target == "cubin" else "compute_90"
    extra = [b"--ptxas-options=-v"] if target == "cubin" else []
    options = moe_quant_mma.compile_options(arch, cols, rows, 1, shape, early, fmt, dense=normed, combine=combine,
                                            normed=normed)
    return nvrtc_compile(moe_quant_mma.source(), options + extra, target=target)


@pytest.mark.parametrize("fmt, hidden, inter, top_k, early", [
    ("int4", *A3B, 8, True), ("int4", *A3B, 8, False), ("fp8", *A3B, 8, True), ("fp8", *A3B, 8, False),
    ("int4", 64, 32, 2, True), ("fp8", 48, 48, 3, False)])  # fp8 48: a partial step and scale block
def test_the_combine_entry_compiles_for_hopper_without_spills_and_waits_first(fmt, hidden, inter, top_k, early):
    """Early: only the tables, weights and residual (scalar loads) and the codes (ld.global.cs) before the wait,
    never h (16-byte loads of f32) and no store; else nothing before it."""
    _nvrtc()
    entry, shape = moe_quant_mma.COMBINE_ENTRY, moe_quant_mma.combine_shape(fmt)
    ptx, _ = _compile(fmt, inter, hidden, shape, early, "ptx", combine=top_k)
    assert f".entry {entry}".encode() in ptx and b"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert_waits_first(ptx, early)
    cubin, log = _compile(fmt, inter, hidden, shape, early, combine=top_k)
    assert cubin and spill_stores(log, entry) == 0, log


@pytest.mark.parametrize("rows, cols, early", [(5120, 2048, True), (5120, 2048, False), (40, 192, True)])
def test_the_normed_entry_compiles_for_hopper_without_spills_and_waits_first(rows, cols, early):
    """The squares are read after the wait (16-byte loads of f32, as x): only weights before it. Without the early
    weights (not the decode's choice: linear_quant_mma.LOAD_BEFORE_WAIT) the H200 machine's ptxas spilled 12 bytes."""
    _nvrtc()
    entry, shape = moe_quant_mma.NORMED_ENTRY, linear_quant_mma.shape_for(cols)
    ptx, _ = _compile("fp8", cols, rows, shape, early, "ptx", normed=True)
    assert f".entry {entry}".encode() in ptx and b"rsqrt.approx.f32" in ptx
    assert_waits_first(ptx, early)
    cubin, log = _compile("fp8", cols, rows, shape, early, normed=True)
    assert cubin and spill_stores(log, entry) <= (0 if early else 16), log


def test_the_entries_refuse_what_they_cannot_take():
    shape = moe_quant_mma.combine_shape("int4")
    for bad in (dict(mats=2), dict(dense=True), dict(shape=(2, 3, 2, 1)), dict(rows=2056), dict(combine=33),
                dict(shape=(1, 6, 1, 1))):  # 6 warps a pair x 8 pairs: more than 1,024 threads
        args = dict(arch="sm_90", cols=768, rows=2048, mats=1, shape=shape, fmt="int4", combine=8) | bad
        with pytest.raises(ValueError):
            moe_quant_mma.compile_options(**args)
    for bad in (dict(dense=False), dict(route=32), dict(cols=2080)):
        args = dict(arch="sm_90", cols=2048, rows=5120, mats=1, shape=(1, 8, 4, 4), fmt="fp8", dense=True,
                    normed=True) | bad
        with pytest.raises(ValueError):
            moe_quant_mma.compile_options(**args)


def test_the_switch_is_read_at_each_call(rng, monkeypatch):
    """Off: never; in the simulator: never (no NVRTC kernels), whatever the switch."""
    layout = ExpertLayout("int4", 64, 32)
    arena = _arena(rng, layout)
    monkeypatch.setattr(moe_quant_mma, "COMBINE", False)
    assert not moe_quant_mma.takes_combine(layout, 2, arena, arena, None)
    if SIMULATOR:
        monkeypatch.setattr(moe_quant_mma, "COMBINE", True)
        assert not moe_quant_mma.takes_combine(layout, 2, arena, arena, None)


def _combine_case(rng, layout, top_k):
    """h (top_k, I), weights (1, top_k) that sum to one, a residual (1, D), pairs [(slot, rank)]: arena slots 2, 1,
    0 and host-store rows 0, 1 in turn (misses), the ranks a permutation."""
    h = rng.standard_normal((top_k, layout.inter), dtype=np.float32)
    weights = rng.random((1, top_k), dtype=np.float32) + 0.1
    weights /= weights.sum()
    residual = rng.standard_normal((1, layout.hidden), dtype=np.float32) * 2
    ranks = rng.permutation(top_k)
    pairs = [((2, -1, 1, -2, 0)[j % 5], int(ranks[j])) for j in range(top_k)]
    return h, weights, residual, pairs


@pytest.mark.parametrize("fmt, hidden, inter, top_k", [("int4", *A3B, 8), ("fp8", *A3B, 8), ("int4", 64, 32, 2),
                                                        ("fp8", 48, 48, 3)])
def test_the_combine_arithmetic_is_the_models_within_f32_rounding(rng, fmt, hidden, inter, top_k):
    """down_combine_ref against expert_ffn_mma_ref's down rows put through combine_add_rmsnorm_ref (numpy only)."""
    layout = ExpertLayout(fmt, hidden, inter)
    arena, store = _arena(rng, layout, 3), _arena(rng, layout, 2)
    h, weights, residual, pairs = _combine_case(rng, layout, top_k)
    total, square = moe_quant_mma_ref.down_combine_ref(h, pairs, weights, residual, arena, layout, store)
    shape = moe_quant_mma.combine_shape(fmt)
    rows = [moe_quant_mma_ref.down_combine_ref(h[j:j + 1], [(slot, 0)], np.ones(1), np.zeros((1, hidden)), arena,
                                               layout, store, shape)[0][0] for j, (slot, _) in enumerate(pairs)]
    y_pair = np.zeros((top_k, hidden), np.float32)
    for (_, rank), row in zip(pairs, rows):
        y_pair[rank] = row
    want_total, _ = combine_add_rmsnorm_ref(y_pair, weights, residual, np.ones(hidden, np.float32), 1e-6)
    np.testing.assert_allclose(total, want_total, rtol=1e-6, atol=1e-6 * np.abs(want_total).max())
    np.testing.assert_allclose(square, (want_total.reshape(-1, 16).astype(np.float64) ** 2).sum(axis=1), rtol=1e-6)


def test_the_normed_arithmetic_is_the_norm_then_the_projection(rng):
    """normed_ref of x and its tiles' squares: dense_ref of rmsnorm_ref(x) within f32 rounding of 1 / rms."""
    cols, rows = 192, 40
    x = rng.standard_normal((1, cols), dtype=np.float32) * 3
    weight = stored(1 + 0.1 * rng.standard_normal(cols, dtype=np.float32), "bf16")
    codes, scales = fp8_rows(_weight(rng, rows, cols))
    square = (x.reshape(-1, 16).astype(np.float64) ** 2).sum(axis=1).astype(np.float32)
    got = moe_quant_mma_ref.normed_ref(x, square, stored_f32(weight), 1e-6, codes, scales)
    want = moe_quant_mma_ref.dense_ref(rmsnorm_ref(x, stored_f32(weight), 1e-6), codes, scales)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())  # x in f16: 1 / rms's ulp


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("fmt, hidden, inter, top_k", [("int4", *A3B, 8), ("fp8", *A3B, 8), ("int4", 64, 32, 2),
                                                        ("fp8", 48, 48, 3)])
def test_the_combine_entry_matches_its_arithmetic_and_the_launches_it_replaces(rng, fmt, hidden, inter, top_k):
    """launch_down_combine (early and not: the same bits) against down_combine_ref (tight) and against launch_down
    then combine_add_rmsnorm_ref on its rows (f32 sums in another order)."""
    from moebus.cuda.kernels.compat import cuda

    layout = ExpertLayout(fmt, hidden, inter)
    arena, store = _arena(rng, layout, 3), _arena(rng, layout, 2)
    h, weights, residual, pairs = _combine_case(rng, layout, top_k)
    slots = np.array([p[0] for p in pairs], np.int32)
    ranks = np.array([p[1] for p in pairs], np.int32)
    stream = cuda.stream()
    held = [device(v) for v in (h, slots, ranks, weights, arena, store, residual)]
    d_h, d_slots, d_ranks, d_weights, d_arena, d_store, d_residual = held
    got = {}
    for early in (False, True):
        total, square = poisoned((1, hidden)), poisoned((hidden // 16,))
        moe_quant_mma.launch_down_combine(d_h, d_slots, d_ranks, d_weights, d_arena, d_store, layout, d_residual,
                                          total, square, stream, early=early)
        got[early] = total.copy_to_host(stream=stream), square.copy_to_host(stream=stream)
    y_pair = poisoned((top_k, hidden))
    moe_quant_mma.launch_down(d_h, device(np.arange(top_k, dtype=np.int32)), d_slots, d_ranks, d_arena, d_store,
                              layout, y_pair, stream, early=False)
    y = y_pair.copy_to_host(stream=stream)
    stream.synchronize()
    for a, b in zip(got[False], got[True]):
        np.testing.assert_array_equal(a, b)
    total, square = got[False]
    want_total, want_square = moe_quant_mma_ref.down_combine_ref(h, pairs, weights, residual, arena, layout, store)
    scale = np.abs(want_total).max()
    np.testing.assert_allclose(total, want_total, rtol=1e-4, atol=2e-5 * scale)
    np.testing.assert_allclose(square, want_square, rtol=1e-4)
    plain, _ = combine_add_rmsnorm_ref(y, weights, residual, np.ones(hidden, np.float32), 1e-6)
    np.testing.assert_allclose(total, plain, rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(square, (total.reshape(-1, 16).astype(np.float64) ** 2).sum(axis=1), rtol=1e-5)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("rows, cols", [(5120, 2048), (40, 192)])
def test_the_normed_entry_matches_its_arithmetic_and_the_norm_then_the_projection(rng, rows, cols):
    from moebus.cuda.kernels.compat import cuda

    x = rng.standard_normal((1, cols), dtype=np.float32) * 3
    weight = stored(1 + 0.1 * rng.standard_normal(cols, dtype=np.float32), "bf16")
    codes, scales = fp8_rows(_weight(rng, rows, cols))
    square = (x.reshape(-1, 16).astype(np.float64) ** 2).sum(axis=1).astype(np.float32)
    stream, out, plain = cuda.stream(), poisoned((1, rows)), poisoned((1, rows))
    d_codes, d_scales = device(codes), device(scales)
    linear_quant_mma.launch_normed(device(x), d_codes, d_scales, device(square), device(weight), 1e-6, out, stream)
    linear_quant_mma.launch(device(rmsnorm_ref(x, stored_f32(weight), 1e-6)), d_codes, d_scales, plain, stream)
    got, want = out.copy_to_host(stream=stream), plain.copy_to_host(stream=stream)
    stream.synchronize()
    expected = moe_quant_mma_ref.normed_ref(x, square, stored_f32(weight), 1e-6, codes, scales)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max())
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())


@pytest.fixture(scope="module")
def micro_64_model(tmp_path_factory):
    """The micro model with a hidden size of 64 (whole float4 of 16-row tiles' squares), heads of 64 (the fused q|k|v
    projection: fused.can_fuse_heads) and whole int4 words."""
    from tests.cuda.test_e2e import init_micro

    return init_micro(tmp_path_factory, "micro_64", hidden_size=64, head_dim=64, moe_intermediate_size=32)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("experts, routed", [("int4", False), ("fp8", False), ("int4", True)])
def test_decode_with_the_combine_gives_the_same_greedy_tokens(micro_64_model, monkeypatch, experts, routed):
    """Quantized experts all resident, FP8 attention on tensor cores: with COMBINE the decode's down GEMVs end in the
    combine and the next layer's q|k|v normalizes (both counted), after the plain gate|up or (``routed``) the one
    ending the routing; the tokens of the plain path, log p close."""
    from moebus.workers.local import LocalModel

    monkeypatch.setattr(moe_quant_mma, "ROUTED", routed)
    prompt, runs, combined, normed = [5, 17, 42, 9, 77], {}, [], []
    real, real_normed = moe_quant_mma.launch_down_combine, linear_quant_mma.launch_normed
    monkeypatch.setattr(moe_quant_mma, "launch_down_combine", lambda *a, **k: combined.append(1) or real(*a, **k))
    monkeypatch.setattr(linear_quant_mma, "launch_normed", lambda *a, **k: normed.append(1) or real_normed(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(moe_quant_mma, "COMBINE", on)
        runs[on] = LocalModel(micro_64_model, device="cuda", max_context=32, experts_dtype=experts,
                              attention_dtype="fp8").generate(prompt, 4)
        assert (bool(combined), bool(normed)) == (on, on), (on, len(combined), len(normed))
    assert runs[True].tokens == runs[False].tokens, (runs[True].tokens, runs[False].tokens)
    # 1 / rms from other sums: x rounded to f16 for the q|k|v GEMV may then round the other way (decode_on_and_off's)
    np.testing.assert_allclose(runs[True].logprobs, runs[False].logprobs, atol=2e-3)
