"""The routing's end of one decode token in CUDA C (route_end.cu, in place of norm_route.route_tail's numba kernel):
compiled by NVRTC for sm_90 without spills, only the norm's weights read before its wait; the options it refuses; the
switch; on a GPU every output against route_tail_cuda's bit for bit and against route_tail_ref, for A3B's shapes and
small ones (a partial quad of partials, ties, host-store misses), a lane an expert (<= 32) and 4 a lane (WIDE: 128,
Qwen3-30B-A3B's); and a decode through it giving route_tail's tokens and log p bit for bit (32 and 128 experts)."""
import numpy as np
import pytest

from moebus.cuda.kernels import route_end
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.moe_quant_mma_ref import route_partials_ref
from moebus.cuda.kernels.norm_route import route_tail_cuda, route_tail_ref
from moebus.cuda.dtypes import to_f32
from tests.cuda.conftest import device, poisoned, stored
from tests.cuda.test_moe_quant_mma import _nvrtc, spill_stores
from tests.cuda.test_down_combine import micro_64_model  # noqa: F401 - the module's fixture

OUTPUTS = ("h", "ids", "weights", "pair_token", "pair_slot", "pair_out")


@pytest.mark.parametrize("experts, dim", [(32, 2048), (5, 144), (128 // 4, 4096), (128, 2048), (60, 144)])
def test_it_compiles_without_spills_and_reads_only_weights_before_its_wait(experts, dim):
    from moebus.cuda.kernels import pdl
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    _nvrtc()
    source = route_end.source()
    ptx, _ = nvrtc_compile(source, route_end.compile_options("compute_90", experts, dim), target="ptx")
    at = ptx.index(b"griddepcontrol.wait")
    before = ptx[:at]
    assert before.count(b"ld.global") == before.count(b"ld.global.cs") > 0 and b"st.global" not in before
    assert (b"griddepcontrol.launch_dependents" in ptx[at:]) == pdl.trigger_after_wait()
    cubin, log = nvrtc_compile(source, route_end.compile_options("sm_90", experts, dim) + [b"--ptxas-options=-v"])
    assert cubin and spill_stores(log, route_end.ENTRY) == 0, log


def test_it_refuses_what_it_cannot_take():
    for experts, dim in ((129, 2048), (0, 2048), (32, 2056)):
        with pytest.raises(ValueError):
            route_end.compile_options("sm_90", experts, dim)


def test_the_switch_and_the_simulator(rng, monkeypatch):
    """Off: never; in the simulator: never (no NVRTC kernels)."""
    partial, total = np.zeros((8, 5), np.float32), np.zeros((1, 128), np.float32)
    weight = np.zeros(128, np.uint16)
    monkeypatch.setattr(route_end, "ENABLED", False)
    assert not route_end.takes(partial, total, weight, 2, None)
    assert route_end.WIDE  # more than 32 experts: on since measured faster than route_tail (6.5 against 13.8 us)
    if SIMULATOR:
        monkeypatch.setattr(route_end, "ENABLED", True)
        assert not route_end.takes(partial, total, weight, 2, None)


def _case(rng, experts, dim, top_k, ties):
    total = rng.standard_normal((1, dim), dtype=np.float32)
    norm_weight = stored(1 + 0.1 * rng.standard_normal(dim, dtype=np.float32), "bf16")
    router = stored(rng.standard_normal((experts, dim), dtype=np.float32) * 0.3, "bf16")
    if ties:  # equal logits: ranks by the lower id
        router[1::2] = router[0::2][: experts // 2]
    partial = route_partials_ref(total[0], to_f32(norm_weight), to_f32(router))
    table = np.zeros((3, experts), np.int32)
    table[2] = [(2, -1, 1, -2, 0)[e % 5] for e in range(experts)]  # slots and host-store rows
    return total, norm_weight, partial, table


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("experts, dim, top_k, normalize, ties", [
    (32, 2048, 8, True, False), (32, 2048, 8, False, True), (5, 144, 2, True, False), (4, 64, 4, True, True),
    (128, 2048, 8, True, False), (128, 2048, 8, False, True), (64, 4096, 4, True, True), (60, 144, 6, True, True),
    (33, 64, 32, True, False)])
def test_it_gives_route_tails_bits(rng, experts, dim, top_k, normalize, ties, monkeypatch):
    from moebus.cuda.kernels.compat import cuda

    monkeypatch.setattr(route_end, "WIDE", True)  # (more than 32 experts: the default, whatever the environment)

    total, norm_weight, partial, table = _case(rng, experts, dim, top_k, ties)
    stream = cuda.stream()
    d_partial, d_total, d_norm, d_table = (device(v) for v in (partial, total, norm_weight, table))

    def outputs():
        return [poisoned((1, dim)), poisoned((1, top_k), np.int32), poisoned((1, top_k))] + \
            [poisoned((top_k,), np.int32) for _ in range(3)]

    ours, theirs = outputs(), outputs()
    assert route_end.takes(d_partial, d_total, d_norm, top_k, stream)
    route_end.launch(d_partial, d_total, d_norm, 1e-6, top_k, normalize, d_table, 2, *ours, stream)
    route_tail_cuda(d_partial, d_total, d_norm, 1e-6, top_k, normalize, d_table, 2, *theirs, stream=stream)
    got = [o.copy_to_host(stream=stream) for o in ours]
    want = [o.copy_to_host(stream=stream) for o in theirs]
    stream.synchronize()
    for name, g, w in zip(OUTPUTS, got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    ref = route_tail_ref(partial, total, norm_weight, 1e-6, top_k, normalize, table, 2)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_allclose(got[2], ref[2], rtol=1e-6)
    for name, g, w in zip(OUTPUTS[3:], got[3:], ref[3:]):
        np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.fixture(scope="module")
def micro_128_experts(tmp_path_factory):
    """micro_64_model with 128 experts, 8 a token (Qwen3-30B-A3B's) and an o projection of 2048 inputs (32 heads of
    64: the ROUTE entry's block of 8 warps takes more than 32 experts)."""
    from tests.cuda.test_e2e import init_micro

    return init_micro(tmp_path_factory, "micro_e128", hidden_size=64, head_dim=64, moe_intermediate_size=32,
                      num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("model", ["micro_64_model", "micro_128_experts"])
def test_decode_with_it_gives_route_tails_tokens_bit_for_bit(model, request, monkeypatch):
    """int4 experts, FP8 attention (the o projection's ROUTE entry): route_end (counted) or route_tail, the same
    tokens and log p."""
    from moebus.workers.local import LocalModel

    micro_64_model = request.getfixturevalue(model)
    monkeypatch.setattr(route_end, "WIDE", True)
    prompt, runs, calls = [5, 17, 42, 9, 77], {}, []
    real = route_end.launch
    monkeypatch.setattr(route_end, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(route_end, "ENABLED", on)
        runs[on] = LocalModel(micro_64_model, device="cuda", max_context=32, experts_dtype="int4",
                              attention_dtype="fp8").generate(prompt, 4)
        assert bool(calls) == on
    assert runs[True].tokens == runs[False].tokens
    np.testing.assert_array_equal(runs[True].logprobs, runs[False].logprobs)
