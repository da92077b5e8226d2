"""The routed decode's gate|up GEMV running beside route_tail's kernel (moe_quant_mma.AHEAD: the ROUTED entry built with
AHEAD): compiled by NVRTC for sm_90 without spills, no store before its wait (AHEAD 2: the trigger first); the options
it refuses; the switch; on a GPU its h against the ROUTED entry's (the same bits) with route_tail's tables, with
host-store misses; and a decode through the backend's four launches giving the greedy tokens of the plain path."""
import numpy as np
import pytest

from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.kernels import moe_quant_mma
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.norm_route import route_tail_cuda
from tests.cuda.conftest import device, poisoned
from tests.cuda.test_down_combine import micro_64_model  # noqa: F401 - the module's fixture
from tests.cuda.test_moe_quant import _arena
from tests.cuda.test_moe_quant_mma import _nvrtc, spill_stores
from tests.cuda.test_routed_gate_up import _case, _outputs


def _compile(fmt, hidden, inter, experts, ahead, target="cubin"):
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    arch = "sm_90" if target == "cubin" else "compute_90"
    extra = [b"--ptxas-options=-v"] if target == "cubin" else []
    options = moe_quant_mma.compile_options(arch, hidden, inter, 2, moe_quant_mma.routed_shape(fmt), False, fmt,
                                            routed=experts, ahead=ahead)
    return nvrtc_compile(moe_quant_mma.source(), options + extra, target=target)


@pytest.mark.parametrize("fmt, hidden, inter, experts, ahead", [
    ("int4", 2048, 768, 32, 1), ("int4", 2048, 768, 32, 2), ("fp8", 2048, 768, 32, 1), ("fp8", 144, 48, 5, 2)])
def test_the_ahead_entry_compiles_without_spills_and_stores_after_its_wait(fmt, hidden, inter, experts, ahead):
    """Before griddepcontrol.wait: the routing's and the GEMV's loads, no store or atomic; the trigger after the wait
    (AHEAD 1, where pdl.trigger_after_wait) or before any load but the norm's weights' (AHEAD 2)."""
    from moebus.cuda.kernels import pdl

    _nvrtc()
    entry = moe_quant_mma.AHEAD_ENTRY
    ptx, _ = _compile(fmt, hidden, inter, experts, ahead, "ptx")
    body = ptx[ptx.index(f".entry {entry}".encode()):]
    at = body.index(b"griddepcontrol.wait")
    before, after = body[:at], body[at:]
    assert b"ld.global" in before and b"mma.sync" in before and not any(op in before for op in (b"st.global", b"atom."))
    assert b"st.global" in after
    if ahead == 2:
        first = before[:before.index(b"griddepcontrol.launch_dependents")]  # only the norm's weights before it
        assert first.count(b"ld.global") == first.count(b"ld.global.cs"), first[-400:]
    else:
        assert b"griddepcontrol.launch_dependents" not in before
        assert (b"griddepcontrol.launch_dependents" in after) == pdl.trigger_after_wait()
    cubin, log = _compile(fmt, hidden, inter, experts, ahead)
    assert cubin and spill_stores(log, entry) == 0, log


def test_the_ahead_entry_refuses_what_it_cannot_take():
    shape = moe_quant_mma.INT4_ROUTED_SHAPE
    for bad in (dict(routed=0), dict(ahead=3), dict(early=True)):
        args = dict(arch="sm_90", cols=2048, rows=768, mats=2, shape=shape, fmt="int4", routed=32, ahead=1) | bad
        with pytest.raises(ValueError):
            moe_quant_mma.compile_options(**args)


def test_the_switch_is_read_at_each_call(rng, monkeypatch):
    """Off: never; in the simulator: never (no NVRTC kernels), whatever the switch."""
    layout = ExpertLayout("int4", 32, 32)
    arena = _arena(rng, layout)
    monkeypatch.setattr(moe_quant_mma, "AHEAD", 0)
    assert not moe_quant_mma.takes_ahead(layout, 4, 2, arena, arena, None)
    if SIMULATOR:
        monkeypatch.setattr(moe_quant_mma, "AHEAD", 1)
        assert not moe_quant_mma.takes_ahead(layout, 4, 2, arena, arena, None)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("fmt, hidden, inter, experts, top_k, normalize, ahead", [
    ("int4", 2048, 768, 32, 8, True, 1), ("int4", 2048, 768, 32, 8, True, 2), ("fp8", 2048, 768, 32, 8, True, 1),
    ("int4", 256, 128, 5, 2, False, 2), ("fp8", 144, 48, 4, 3, True, 1)])
def test_the_ahead_entry_gives_the_routed_entrys_bits(rng, monkeypatch, fmt, hidden, inter, experts, top_k, normalize,
                                                      ahead):
    """route_tail_cuda then launch_gate_up_ahead against launch_gate_up_routed: h the same bits, with hits and
    host-store misses; the ahead kernel leaves route_tail's tables as they were."""
    from moebus.cuda.kernels.compat import cuda

    monkeypatch.setattr(moe_quant_mma, "AHEAD", ahead)
    layout = ExpertLayout(fmt, hidden, inter)
    arena, store = _arena(rng, layout, 3), _arena(rng, layout, 2)
    total, norm_weight, partial, table = _case(rng, layout, experts, top_k)
    stream = cuda.stream()
    d_total, d_norm, d_partial, d_table, d_arena, d_store = (device(v) for v in
                                                             (total, norm_weight, partial, table, arena, store))
    routed = _outputs(top_k, inter)
    moe_quant_mma.launch_gate_up_routed(d_total, d_partial, d_norm, 1e-6, d_table, 1, top_k, normalize, d_arena,
                                        d_store, layout, *routed, stream)
    tables, h = _outputs(top_k, inter)[:5], poisoned((top_k, inter))
    route_tail_cuda(d_partial, d_total, d_norm, 1e-6, top_k, normalize, d_table, 1, poisoned((1, hidden)), *tables,
                    stream=stream)
    moe_quant_mma.launch_gate_up_ahead(d_total, d_partial, d_norm, 1e-6, d_table, 1, top_k, normalize, d_arena,
                                       d_store, layout, h, stream)
    got = [o.copy_to_host(stream=stream) for o in tables + [h]]
    want = [o.copy_to_host(stream=stream) for o in routed]
    stream.synchronize()
    for name, g, w in zip(("ids", "weights", "pair_token", "pair_slot", "pair_out", "h"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert np.any(got[3] < 0) and np.any(got[3] >= 0), "hits and host-store misses"


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("ahead", [1, 2])
def test_decode_with_the_gate_up_ahead_gives_the_same_greedy_tokens(micro_64_model, monkeypatch, ahead):
    """int4 experts all resident, FP8 attention on tensor cores, the down ending in the combine: with AHEAD the
    decode's gate|up routes itself beside route_tail (counted), its down early or not as AHEAD says; the plain path's
    tokens (another gate|up shape: log p close)."""
    from moebus.workers.local import LocalModel

    prompt, runs, calls, early = [5, 17, 42, 9, 77], {}, [], []
    real, real_down = moe_quant_mma.launch_gate_up_ahead, moe_quant_mma.launch_down_combine
    monkeypatch.setattr(moe_quant_mma, "launch_gate_up_ahead", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(moe_quant_mma, "launch_down_combine",
                        lambda *a, **k: early.append(k.get("early")) or real_down(*a, **k))
    for on in (0, ahead):
        monkeypatch.setattr(moe_quant_mma, "AHEAD", on)
        early.clear()
        runs[on] = LocalModel(micro_64_model, device="cuda", max_context=32, experts_dtype="int4",
                              attention_dtype="fp8").generate(prompt, 4)
        assert bool(calls) == bool(on), (on, len(calls))
        if on:
            assert early and all(e is (None if ahead == 1 else False) for e in early), early
    assert runs[ahead].tokens == runs[0].tokens, (runs[ahead].tokens, runs[0].tokens)
    np.testing.assert_allclose(runs[ahead].logprobs, runs[0].logprobs, atol=2e-3)
