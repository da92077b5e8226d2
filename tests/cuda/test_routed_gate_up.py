"""The routed decode's gate|up GEMV ending the routing (moe_quant_mma.ROUTED: moe_quant_mma.cu's ROUTED entry, in place
of norm_route.route_tail's kernel): compiled by NVRTC for sm_90 without spills, only the norm's weights read before the
wait; the options it refuses; the switch; on a GPU the entry against route_tail_cuda then the gate|up GEMV (the same
bits: tables, ids, weights and h), against their numpy arithmetic, with host-store misses; and a decode through the
backend's three launches giving the greedy tokens of its four."""
import numpy as np
import pytest

from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.dtypes import to_f32 as stored_f32
from moebus.cuda.kernels import moe_quant_mma, moe_quant_mma_ref
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.moe_quant_mma_ref import route_partials_ref
from moebus.cuda.kernels.norm_route import route_tail_cuda, route_tail_ref
from tests.cuda.conftest import device, poisoned, stored
from tests.cuda.test_moe_quant import _arena
from tests.cuda.test_moe_quant_mma import SPILL_BYTES, _nvrtc, spill_stores
from tests.cuda.test_moe_quant_mma import micro_wide_model  # noqa: F401 - the module's fixture

TABLES = ("ids", "weights", "pair_token", "pair_slot", "pair_out")


def _compile(fmt, hidden, inter, experts, target="cubin"):
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    arch = "sm_90" if target == "cubin" else "compute_90"
    extra = [b"--ptxas-options=-v"] if target == "cubin" else []
    options = moe_quant_mma.compile_options(arch, hidden, inter, 2, moe_quant_mma.routed_shape(fmt), False, fmt,
                                            routed=experts)
    return nvrtc_compile(moe_quant_mma.source(), options + extra, target=target)


@pytest.mark.parametrize("fmt, hidden, inter, experts", [("int4", 2048, 768, 32), ("fp8", 2048, 768, 32),
                                                          ("int4", 32, 32, 4), ("fp8", 144, 48, 5)])
def test_the_routed_entry_compiles_for_hopper_without_spills_and_waits_first(fmt, hidden, inter, experts):
    """Before griddepcontrol.wait: only streamed loads (ld.global.cs: the norm's weights), no other read or write; the
    spills the plain gate|up may have (SPILL_BYTES: fp8's 4 bytes, on some ptxas versions)."""
    from moebus.cuda.kernels import pdl

    _nvrtc()
    entry = moe_quant_mma.ROUTED_ENTRY
    ptx, _ = _compile(fmt, hidden, inter, experts, "ptx")
    assert f".entry {entry}".encode() in ptx and b"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    at = ptx.index(b"griddepcontrol.wait")
    before = ptx[:at]
    assert b"ld.global.cs" in before and not any(op in before for op in (b"st.global", b"atom."))
    assert before.count(b"ld.global") == before.count(b"ld.global.cs"), before[-400:]
    assert (b"griddepcontrol.launch_dependents" in ptx[at:]) == pdl.trigger_after_wait()
    cubin, log = _compile(fmt, hidden, inter, experts)
    assert cubin and spill_stores(log, entry) <= SPILL_BYTES.get((fmt, 2, moe_quant_mma.routed_shape(fmt)), 0), log


def test_the_routed_entry_refuses_what_it_cannot_take():
    shape = moe_quant_mma.INT4_ROUTED_SHAPE
    for bad in (dict(mats=1), dict(routed=33), dict(dense=True, fmt="fp8"), dict(cols=2056, fmt="fp8")):
        args = dict(arch="sm_90", cols=2048, rows=768, mats=2, shape=shape, fmt="int4", routed=32) | bad
        with pytest.raises(ValueError):
            moe_quant_mma.compile_options(**args)
    with pytest.raises(ValueError):  # as many experts as threads: a thread an expert, one to spare
        moe_quant_mma.compile_options("sm_90", 2048, 768, 2, (1, 1, 4, 1), fmt="int4", routed=32)


def test_the_switch_is_read_at_each_call(rng, monkeypatch):
    """Off: never; in the simulator: never (no NVRTC kernels), whatever the switch."""
    layout = ExpertLayout("int4", 32, 32)
    arena = _arena(rng, layout)
    monkeypatch.setattr(moe_quant_mma, "ROUTED", False)
    assert not moe_quant_mma.takes_routed(layout, 4, 2, arena, arena, None)
    if SIMULATOR:
        monkeypatch.setattr(moe_quant_mma, "ROUTED", True)
        assert not moe_quant_mma.takes_routed(layout, 4, 2, arena, arena, None)


def _case(rng, layout, experts, top_k):
    """total (1, D), bf16 norm weight, the ROUTE entry's partials of a bf16 router, a placement table (2, E) whose
    row 1 gives the chosen experts, by rank, arena slots 2, 1, 0 and host-store rows 0, 1 in turn (misses), the
    others slot 0."""
    dim = layout.hidden
    total = rng.standard_normal((1, dim), dtype=np.float32)
    norm_weight = stored(1 + 0.1 * rng.standard_normal(dim, dtype=np.float32), "bf16")
    router = stored(rng.standard_normal((experts, dim), dtype=np.float32) * 0.3, "bf16")
    partial = route_partials_ref(total[0], stored_f32(norm_weight), stored_f32(router))
    table = np.zeros((2, experts), np.int32)
    _, ids, *_ = route_tail_ref(partial, total, norm_weight, 1e-6, top_k, True, table, 1)
    table[1, ids[0]] = [(2, -1, 1, -2, 0)[k % 5] for k in range(top_k)]
    return total, norm_weight, partial, table


def _outputs(top_k, inter):
    return [poisoned((1, top_k), np.int32), poisoned((1, top_k))] + [poisoned((top_k,), np.int32) for _ in range(3)] \
        + [poisoned((top_k, inter))]


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("fmt, hidden, inter, experts, top_k, normalize", [
    ("int4", 2048, 768, 32, 8, True), ("fp8", 2048, 768, 32, 8, True),  # A3B's shapes
    ("int4", 256, 128, 5, 2, False), ("fp8", 144, 48, 4, 3, True)])  # fp8: a partial step and scale block
def test_the_routed_entry_gives_route_tail_and_gate_up_bits(rng, fmt, hidden, inter, experts, top_k, normalize):
    """One launch against route_tail_cuda then launch_gate_up on its tables and h: every output the same bits; the
    tables against route_tail_ref, h against the GEMV's numpy arithmetic (moe_quant_mma_ref) of route_tail_ref's h."""
    from moebus.cuda.kernels.compat import cuda

    layout = ExpertLayout(fmt, hidden, inter)
    arena, store = _arena(rng, layout, 3), _arena(rng, layout, 2)
    total, norm_weight, partial, table = _case(rng, layout, experts, top_k)
    stream = cuda.stream()
    held = [device(v) for v in (total, norm_weight, partial, table, arena, store)]
    d_total, d_norm, d_partial, d_table, d_arena, d_store = held
    fused = _outputs(top_k, inter)
    moe_quant_mma.launch_gate_up_routed(d_total, d_partial, d_norm, 1e-6, d_table, 1, top_k, normalize, d_arena,
                                        d_store, layout, *fused, stream)
    h_normed, two = poisoned((1, hidden)), _outputs(top_k, inter)
    route_tail_cuda(d_partial, d_total, d_norm, 1e-6, top_k, normalize, d_table, 1, h_normed, *two[:5], stream=stream)
    moe_quant_mma.launch_gate_up(h_normed, two[2], two[3], two[4], d_arena, d_store, layout, two[5], stream,
                                 moe_quant_mma.routed_shape(fmt))  # the same shape: the same sums
    got = [o.copy_to_host(stream=stream) for o in fused]
    want = [o.copy_to_host(stream=stream) for o in two]
    stream.synchronize()
    for name, g, w in zip(TABLES + ("h",), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    h, *tables = route_tail_ref(partial, total, norm_weight, 1e-6, top_k, normalize, table, 1)
    for name, g, w in zip(TABLES, got, tables):
        if name == "weights":
            np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)
    assert np.any(tables[3] < 0) and np.any(tables[3] >= 0), "hits and host-store misses"
    pairs = list(zip(tables[2], tables[3], range(top_k)))
    expected, _ = moe_quant_mma_ref.expert_ffn_mma_ref(h, pairs, arena, layout, store)
    np.testing.assert_allclose(got[5], expected, rtol=1e-4, atol=2e-5 * np.abs(expected).max())


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_decode_with_the_routed_gate_up_gives_the_same_greedy_tokens(micro_wide_model, monkeypatch):
    """int4 experts all resident, FP8 attention on tensor cores: the decode's gate|up ending the routing (counted)
    gives the tokens and log p of route_tail then the GEMV (the same bits by the test above); its down GEMV never
    reads the pair tables before its wait (they are the gate|up kernel's own writes)."""
    from moebus.workers.local import LocalModel

    prompt, runs, calls, early = [5, 17, 42, 9, 77], {}, [], []
    real, real_down = moe_quant_mma.launch_gate_up_routed, moe_quant_mma.launch_down
    monkeypatch.setattr(moe_quant_mma, "launch_gate_up_routed", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(moe_quant_mma, "launch_down",
                        lambda *a, **k: early.append(k.get("early")) or real_down(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(moe_quant_mma, "ROUTED", on)
        early.clear()
        runs[on] = LocalModel(micro_wide_model, device="cuda", max_context=32, experts_dtype="int4",
                              attention_dtype="fp8").generate(prompt, 4)
        assert bool(calls) == on
        assert not on or (early and not any(early))
    assert runs[True].tokens == runs[False].tokens
    np.testing.assert_array_equal(runs[True].logprobs, runs[False].logprobs)
