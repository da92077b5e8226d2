"""Decode's qkv_rope_store as the tensor-core attention kernel's prologue (rope_attention.py, attention_decode_tc.cu's
ROPE build): compiled by NVRTC for sm_90 without spills, waiting first (EARLY_KV: only the step's inputs read and the
first keys prefetched before the wait); the simulator's fallback (the two kernels) against the reference; on a GPU the
one kernel against the reference and against the two kernels it replaces (one split, two merged in the kernel, many
merged apart; groups of 8 and 4; the token's key first, last and inside a 16-key tile; early and not), the caches'
new rows included; and a decode through the stage with it on and off giving the same tokens."""
import numpy as np
import pytest

from moebus.cuda.dtypes import f32_to_bf16, to_f32
from moebus.cuda.kernels import attention_decode, attention_decode_tc, rope_attention
from moebus.cuda.kernels.attention import attention_scratch_shape
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.rope import rope_tables
from tests.cuda.conftest import device, poisoned
from tests.cuda.test_moe_quant_mma import _nvrtc, spill_stores


def _compile(early: bool, target: str = "cubin"):
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    arch = "sm_90" if target == "cubin" else "compute_90"
    extra = [b"--ptxas-options=-v"] if target == "cubin" else []
    options = attention_decode_tc.compile_options(arch, 4, 2, True, True, early)
    return nvrtc_compile(attention_decode_tc.source(), options + extra, target=target)


@pytest.mark.parametrize("early", [False, True])
def test_the_rope_build_compiles_without_spills_and_waits_first(early):
    _nvrtc()
    ptx, _ = _compile(early, "ptx")
    entry = attention_decode_tc.ROPE_PDL_ENTRY.encode()
    body = ptx[ptx.index(b".entry " + entry + b"("):]
    before = body[:body.index(b"griddepcontrol.wait")]
    assert b"st.global" not in before and b"atom." not in before
    if early:  # the token's position and slot (the step's inputs), and the first keys' lines: hints only
        assert before.count(b"ld.global") == 2 and b"prefetch.global.L1" in before, before[-600:]
    else:
        assert b"ld.global" not in before and b"prefetch" not in before
    cubin, log = _compile(early)
    assert cubin and spill_stores(log.decode() if isinstance(log, bytes) else log,
                                  attention_decode_tc.ROPE_PDL_ENTRY) == 0


def _case(rng, num_tokens, heads, kv_heads, context, positions, hd=128):
    qkv = rng.standard_normal((num_tokens, (heads + 2 * kv_heads) * hd), dtype=np.float32)
    q_weight, k_weight = (f32_to_bf16(1.0 + 0.2 * rng.standard_normal(hd, dtype=np.float32)) for _ in range(2))
    k, v = (f32_to_bf16(rng.standard_normal((num_tokens + 1, kv_heads, context, hd), dtype=np.float32))
            for _ in range(2))
    slots = np.arange(num_tokens, dtype=np.int32)[::-1].copy()  # one sequence a token (a decode step)
    pos = np.asarray(positions, np.int32)
    cos, sin = rope_tables(hd, 10000.0, context)
    return qkv, q_weight, k_weight, k, v, slots, pos, cos.astype(np.float32), sin.astype(np.float32)


def _reference(case, heads, kv_heads, scale):
    qkv, qw, kw, k, v, slots, pos, cos, sin = case
    k, v = k.copy(), v.copy()
    out = rope_attention.rope_attention_ref(qkv, heads, kv_heads, qw, kw, 1e-6, slots, pos, cos, sin, k, v, scale)
    return out, k, v


def test_the_simulator_runs_the_two_kernels_and_matches_the_reference(rng):
    """Where the one kernel does not take a step (here: the simulator, or hd 64), rope_attention_cuda runs
    qkv_rope_store then the attention into q_out."""
    from moebus.cuda.kernels.compat import cuda

    heads, kv_heads, hd = 4, 2, 64
    case = _case(rng, 2, heads, kv_heads, 24, [5, 17], hd)
    qkv, qw, kw, k, v, slots, pos, cos, sin = case
    stream = cuda.stream()
    assert not rope_attention.takes(heads, qw, kw, cos, k, 0, stream)
    out, q_out = poisoned((2, heads, hd)), poisoned((2, heads, hd))
    k_dev, v_dev = device(k), device(v)
    rope_attention.rope_attention_cuda(device(qkv), heads, kv_heads, device(qw), device(kw), 1e-6, device(slots),
                                       device(pos), device(cos), device(sin), k_dev, v_dev, 0.125, 0, out,
                                       stream=stream, q_out=q_out)
    want, want_k, want_v = _reference(case, heads, kv_heads, 0.125)
    np.testing.assert_allclose(out.copy_to_host(), want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(to_f32(k_dev.copy_to_host()), to_f32(want_k), atol=1e-2, rtol=1e-2)
    np.testing.assert_array_equal(v_dev.copy_to_host(), want_v)
    with pytest.raises(ValueError, match="q_out"):
        rope_attention.rope_attention_cuda(device(qkv), heads, kv_heads, device(qw), device(kw), 1e-6, device(slots),
                                           device(pos), device(cos), device(sin), k_dev, v_dev, 0.125, 0, out)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("heads, kv_heads, context, positions, merged, early", [
    (32, 4, 64, [0, 15, 16, 63], True, True),       # one split: each token's output written directly
    (32, 4, 128, [64, 100, 127, 7], True, True),    # two splits merged in the kernel (a counter a kv head)
    (16, 4, 700, [699, 300, 17, 64], False, True),  # many splits merged apart
    (32, 4, 128, [64, 100, 127, 7], True, False),   # the wait first
])
def test_the_one_kernel_matches_the_reference_and_the_two_kernels(rng, monkeypatch, heads, kv_heads, context,
                                                                  positions, merged, early):
    from moebus.cuda.kernels import fused
    from moebus.cuda.kernels.attention import attention_cuda
    from moebus.cuda.kernels.compat import cuda

    monkeypatch.setattr(attention_decode_tc, "ROPE_EARLY_KV", early)
    scale = 128 ** -0.5
    case = _case(rng, len(positions), heads, kv_heads, context, positions)
    qkv, qw, kw, k, v, slots, pos, cos, sin = case
    stream = cuda.stream()
    assert rope_attention.takes(heads, qw, kw, device(cos), device(k), 0, stream)
    shape = (len(positions), heads, 128)
    scratch = lambda: poisoned(attention_scratch_shape(*shape, context))  # noqa: E731
    done = lambda: device(np.zeros(len(positions) * kv_heads, np.int32))  # noqa: E731
    args = (device(qw), device(kw), 1e-6, device(slots), device(pos), device(cos), device(sin))
    k_one, v_one, out_one = device(k), device(v), poisoned(shape)
    rope_attention.rope_attention_cuda(device(qkv), heads, kv_heads, *args, k_one, v_one, scale, 0, out_one,
                                       scratch(), stream=stream, done=done())
    k_two, v_two, out_two, q_two = device(k), device(v), poisoned(shape), poisoned(shape)
    fused.qkv_rope_store_cuda(device(qkv), heads, kv_heads, *args, k_two, v_two, q_two, stream=stream)
    attention_cuda(q_two, k_two, v_two, args[3], args[4], scale, 0, out_two, scratch(), stream=stream, done=done())
    got = {name: a.copy_to_host(stream=stream) for name, a in
           (("out", out_one), ("k", k_one), ("v", v_one), ("out2", out_two), ("k2", k_two), ("v2", v_two))}
    stream.synchronize()
    want, want_k, want_v = _reference(case, heads, kv_heads, scale)
    np.testing.assert_allclose(got["out"], want, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(got["v"], want_v)
    np.testing.assert_allclose(to_f32(got["k"]), to_f32(want_k), atol=1e-2, rtol=1e-2)  # a bf16 rounding apart
    # against the two kernels: the same expressions, so the same cache rows and outputs within f32 rounding
    np.testing.assert_array_equal(got["v"], got["v2"])
    assert np.mean(got["k"] != got["k2"]) < 1e-3, np.mean(got["k"] != got["k2"])
    np.testing.assert_allclose(got["out"], got["out2"], atol=2e-5, rtol=1e-4)  # where a k rounds the other way


@pytest.fixture(scope="module")
def micro_128_model(tmp_path_factory):
    """The micro model with heads of 128 (the tensor-core attention's), a group of 2, hidden 64."""
    from tests.cuda.test_e2e import init_micro

    return init_micro(tmp_path_factory, "micro_128", hidden_size=64, head_dim=128, moe_intermediate_size=32)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("experts, attention", [("bf16", "bf16"), ("int4", "fp8")])
def test_decode_with_the_one_kernel_gives_the_same_greedy_tokens(micro_128_model, monkeypatch, experts, attention):
    """bf16 caches: with ENABLED the decode's attention takes qkv_rope_store's work (counted), after the plain
    projection (bf16) or the one that normalizes x (int4 experts, FP8 attention); the tokens of the two kernels."""
    from moebus.workers.local import LocalModel

    prompt, runs, launched = [5, 17, 42, 9, 77], {}, []
    real = attention_decode_tc.launch_rope
    monkeypatch.setattr(attention_decode_tc, "launch_rope", lambda *a, **k: launched.append(1) or real(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(rope_attention, "ENABLED", on)
        runs[on] = LocalModel(micro_128_model, device="cuda", max_context=96, experts_dtype=experts,
                              attention_dtype=attention, kv_dtype="bf16").generate(prompt, 6)
        assert bool(launched) == on, (on, len(launched))
    assert runs[True].tokens == runs[False].tokens, (runs[True].tokens, runs[False].tokens)
    np.testing.assert_allclose(runs[True].logprobs, runs[False].logprobs, atol=1e-4)
