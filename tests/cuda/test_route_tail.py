"""The routed decode's o projection with norm_route's start (linear_quant_mma.ROUTE: moe_quant_mma.cu's ROUTE entry,
then norm_route.route_tail_cuda): the tail kernel against its numpy arithmetic (simulator and GPU), that arithmetic
against norm_route_ref, the entry compiled by NVRTC without spills and waiting first; on a GPU the entry against the
plain projection plus the residual (the same bits) and its partials' reference, the backend's two launches against
its three, and decodes with the switch on giving the greedy tokens of the switch off."""
import numpy as np
import pytest

from moebus.common.fp8_dense import fp8_rows
from moebus.cuda.dtypes import to_f32 as stored_f32
from moebus.cuda.kernels import linear_quant_mma, moe_quant_mma
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.moe_quant_mma_ref import route_partials_ref
from moebus.cuda.kernels.norm_route import norm_route_ref, route_tail_cuda, route_tail_ref
from tests.cuda.conftest import device, poisoned, stored
from tests.cuda.test_e2e import micro_model  # noqa: F401 - the module's fixture
from tests.cuda.test_linear_quant import _weight
from tests.cuda.test_moe_quant_mma import _nvrtc, assert_waits_first, spill_stores
from tests.cuda.test_moe_quant_mma import _compile as compile_mma

NAMES = ("h", "ids", "weights", "pair_token", "pair_slot", "pair_out")


def _case(rng, dim, experts):
    """(total (1, D), norm weight, router (E, D) as bf16, a placement table (2, E))."""
    total = rng.standard_normal((1, dim), dtype=np.float32)
    norm_weight = stored(1 + 0.1 * rng.standard_normal(dim, dtype=np.float32), "bf16")
    router = stored(rng.standard_normal((experts, dim), dtype=np.float32) * 0.1, "bf16")
    table = rng.integers(-30, 30, size=(2, experts)).astype(np.int32)
    return total, norm_weight, router, table


def _tail(partial, total, norm_weight, top_k, normalize, table):
    outs = [poisoned(total.shape), poisoned((1, top_k), np.int32), poisoned((1, top_k))] + [
        poisoned((top_k,), np.int32) for _ in range(3)]
    route_tail_cuda(device(partial), device(total), device(norm_weight), 1e-6, top_k, normalize, device(table), 1,
                    *outs)
    return [o.copy_to_host() for o in outs]


def _assert_route(got, want, rtol):
    for name, g, w in zip(NAMES, got, want):
        if np.asarray(w).dtype == np.int32:  # ids and the pair tables
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("dim, experts, top_k, normalize", [(64, 32, 8, True), (48, 37, 3, False), (32, 4, 2, True)])
def test_the_tail_kernel_matches_its_arithmetic(rng, dim, experts, top_k, normalize):
    """32 experts: one_token_tail; 37: top-k argmaxes in turn and sort_pairs; 4: the micro model's."""
    total, norm_weight, router, table = _case(rng, dim, experts)
    partial = route_partials_ref(total[0], stored_f32(norm_weight), stored_f32(router))
    want = route_tail_ref(partial, total, norm_weight, 1e-6, top_k, normalize, table, 1)
    _assert_route(_tail(partial, total, norm_weight, top_k, normalize, table), want, 1e-6)


@pytest.mark.parametrize("experts, top_k", [(32, 8), (128, 8)])
def test_the_partials_route_as_norm_route_does(rng, experts, top_k):
    """route_tail_ref of the ROUTE entry's partials: norm_route_ref's choices (no near ties in random data), h and
    the weights within f32 rounding of another summation order; at A3B's hidden size."""
    x = rng.standard_normal((1, 2048), dtype=np.float32)
    y = rng.standard_normal((1, 2048), dtype=np.float32)
    _, norm_weight, router, table = _case(rng, 2048, experts)
    total = x + y
    partial = route_partials_ref(total[0], stored_f32(norm_weight), stored_f32(router))
    got = route_tail_ref(partial, total, norm_weight, 1e-6, top_k, True, table, 1)
    want = norm_route_ref(x, y, norm_weight, 1e-6, router, top_k, True, table, 1)
    _assert_route(got, want[1:], 1e-5)


def test_the_partials_reference_sums_tiles():
    total = np.arange(32, dtype=np.float32)
    partial = route_partials_ref(total, np.full(32, 2, np.float32), np.ones((3, 32), np.float32))
    assert partial.shape == (2, 4)
    np.testing.assert_array_equal(partial[:, 0], [2 * total[:16].sum(), 2 * total[16:].sum()])
    np.testing.assert_array_equal(partial[:, 3], [(total[:16] ** 2).sum(), (total[16:] ** 2).sum()])


def _compile(rows, cols, experts, early=False, target="cubin"):
    return compile_mma(cols, rows, 1, linear_quant_mma.shape_for(cols), early, target, "fp8", dense=True,
                       route=experts)


@pytest.mark.parametrize("rows, cols, experts, early", [(2048, 4096, 32, True), (2048, 4096, 128, True),
                                                        (2048, 4096, 32, False), (32, 32, 4, True)])
def test_the_route_entry_compiles_for_hopper_without_spills(rows, cols, experts, early):
    _nvrtc()
    entry = moe_quant_mma.ROUTE_ENTRY
    ptx, _ = _compile(rows, cols, experts, early, "ptx")
    assert f".entry {entry}".encode() in ptx and b"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert_waits_first(ptx, early)
    cubin, log = _compile(rows, cols, experts, early)
    assert cubin and spill_stores(log, entry) == 0, log


def test_the_route_entry_refuses_shapes_it_cannot_take():
    with pytest.raises(ValueError):
        moe_quant_mma.compile_options("sm_90", 4096, 2040, 1, (1, 16, 4, 1), dense=True, route=32)  # a partial tile
    with pytest.raises(ValueError):
        moe_quant_mma.compile_options("sm_90", 32, 32, 1, (1, 1, 4, 1), dense=True, route=32)  # 32 threads, 32 experts


def test_the_switch_is_read_at_each_call(rng, monkeypatch):
    """Off: never; in the simulator: never (no NVRTC kernels), whatever the switch (on by default)."""
    total, norm_weight, router, _ = _case(rng, 32, 4)
    codes, scales = fp8_rows(_weight(rng, 32, 32))
    args = (np.zeros((1, 32), np.float32), codes, scales, total, norm_weight, router, None)
    assert linear_quant_mma.ROUTE
    monkeypatch.setattr(linear_quant_mma, "ROUTE", False)
    assert not linear_quant_mma.takes_route(*args)
    if SIMULATOR:
        monkeypatch.setattr(linear_quant_mma, "ROUTE", True)
        assert not linear_quant_mma.takes_route(*args)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("rows, cols, experts", [(2048, 4096, 32), (2048, 4096, 128), (32, 32, 4)])
def test_the_route_entry_adds_the_residual_and_sums_the_router(rng, rows, cols, experts):
    """total: the plain projection's output plus the residual, bit for bit; the partials: their reference of that
    total (f32 sums, fma in the kernel)."""
    from moebus.cuda.kernels.compat import cuda

    codes, scales = fp8_rows(_weight(rng, rows, cols))
    a = rng.standard_normal((1, cols), dtype=np.float32)
    total_in, norm_weight, router, _ = _case(rng, rows, experts)
    stream = cuda.stream()
    held = [device(v) for v in (a, codes, scales, total_in, norm_weight, router)]
    total, partial, plain = poisoned((1, rows)), poisoned((rows // 16, experts + 1)), poisoned((1, rows))
    linear_quant_mma.launch_route(*held, total, partial, stream)
    linear_quant_mma.launch(*held[:3], plain, stream)
    got_total, got_partial, got_plain = (o.copy_to_host(stream=stream) for o in (total, partial, plain))
    stream.synchronize()
    np.testing.assert_array_equal(got_total, total_in + got_plain)
    want = route_partials_ref(got_total[0], stored_f32(norm_weight), stored_f32(router))
    np.testing.assert_allclose(got_partial, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_decode_with_the_route_switch_gives_the_same_greedy_tokens(micro_model, monkeypatch):  # noqa: F811
    """bf16 experts, FP8 attention on tensor cores: the routed decode's o projection through the ROUTE entry and
    the tail (counted) gives the tokens of the projection then norm_route, log p close."""
    from moebus.workers.local import LocalModel

    prompt, runs, calls = [5, 17, 42, 9, 77], {}, []
    real = linear_quant_mma.launch_route
    monkeypatch.setattr(linear_quant_mma, "launch_route", lambda *a, **k: calls.append(1) or real(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(linear_quant_mma, "ROUTE", on)
        runs[on] = LocalModel(micro_model, device="cuda", max_context=32, attention_dtype="fp8").generate(prompt, 4)
        assert bool(calls) == on
    assert runs[True].tokens == runs[False].tokens
    np.testing.assert_allclose(runs[True].logprobs, runs[False].logprobs, atol=1e-4)
