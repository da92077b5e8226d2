"""The FP8 dense projections at batch 1 on tensor cores (linear_quant_mma.py, MOEBUS_QUANT_MMA=attn): compiled by
NVRTC for sm_90 without spills and waiting first (where the NVRTC wheel is installed); the choice in
linear_fp8_cuda and the kernel's numpy arithmetic within the f16 bound of the exact product (simulator); on a GPU
(MOEBUS_TEST_GPU=1) the kernel against its arithmetic (tight) and against the numba one-round kernel (within the
bound) at A3B's q|k|v and o, a small odd shape, every shape the bench sweeps, x near f16's limits; and decodes with
the option on giving the greedy tokens of the option off."""
import numpy as np
import pytest

from moebus.common.fp8_dense import fp8_rows
from moebus.cuda.kernels import linear_quant, linear_quant_fp8, linear_quant_mma, moe_quant_mma, moe_quant_mma_ref
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.linear_quant import fp8_rows_dequantize, linear_fp8_cuda, linear_fp8_ref
from tests.cuda.conftest import device, poisoned
from tests.cuda.test_e2e import micro_model  # noqa: F401 - the module's fixture
from tests.cuda.test_linear_quant import _weight
from tests.cuda.test_moe_quant_mma import F16_STEP, _nvrtc, assert_waits_first, decode_on_and_off, spill_stores
from tests.cuda.test_moe_quant_mma import _compile as compile_mma
from tests.cuda.test_quant_e2e import micro_fp8_model  # noqa: F401 - the module's fixture

QKV, O, ODD = (5120, 2048), (2048, 4096), (40, 144)  # (rows, cols): A3B's q|k|v and o; partial tiles, steps, blocks


def _compile(cols, rows, shape, early=False, target="cubin"):
    return compile_mma(cols, rows, 1, shape, early, target, "fp8", dense=True)


@pytest.mark.parametrize("rows, cols, shape, early", [
    (*QKV, None, False), (*QKV, None, True), (*O, None, False), (*ODD, None, False),
    *((*QKV, s, False) for s in linear_quant_mma.SWEEP[2048][1:]),
    *((*O, s, False) for s in linear_quant_mma.SWEEP[4096][1:])])
def test_the_dense_kernel_compiles_for_hopper_without_spills(rows, cols, shape, early):
    _nvrtc()
    entry = moe_quant_mma.DENSE_ENTRY
    shape = shape or linear_quant_mma.shape_for(cols)
    ptx, _ = _compile(cols, rows, shape, early, "ptx")
    assert f".entry {entry}".encode() in ptx and b"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    cubin, log = _compile(cols, rows, shape, early)
    assert cubin
    assert spill_stores(log, entry) == 0, log


@pytest.mark.parametrize("early", [False, True])
def test_the_dense_kernel_waits_before_reading_x(early):
    """griddepcontrol.wait before any global read (early, linear_quant_mma.LOAD_BEFORE_WAIT: the weights only,
    ld.global.cs, before it; never x), then the trigger where pdl.trigger_after_wait: the numba kernel's rule."""
    _nvrtc()
    ptx, _ = _compile(256, 48, linear_quant_mma.shape_for(256), early, "ptx")
    assert_waits_first(ptx, early)


def test_shapes_by_the_rows_length(monkeypatch):
    assert linear_quant_mma.shape_for(2048) == (1, 8, 4, 4) and linear_quant_mma.shape_for(4096) == (1, 16, 4, 1)
    assert linear_quant_mma.shape_for(144) == (1, 1, 4, 1) and linear_quant_mma.shape_for(8192) == (1, 16, 4, 1)
    monkeypatch.setattr(linear_quant_mma, "SHAPES", {"2048": [1, 16, 2, 2]})  # as a sweep plan's JSON sets it
    assert linear_quant_mma.shape_for(2048) == (1, 16, 2, 2)


def test_the_switch_names_attn():
    assert moe_quant_mma._formats("attn") == {"attn"}
    assert moe_quant_mma._formats("fp8,attn") == {"fp8", "attn"}
    assert moe_quant_mma._formats("all") == {"fp8", "int4", "attn"}
    assert moe_quant_mma._formats("1") == {"fp8"}
    with pytest.raises(ValueError, match="attn"):
        moe_quant_mma._formats("qkv")


def test_linear_fp8_takes_it_only_with_the_option(rng, monkeypatch):
    """attn (in the default, all): one token with a stream object on whole 16-byte words; not two
    tokens, not the default stream, not rows of 8.5 words; the experts' formats alone leave it off; off: the numba
    kernel."""
    monkeypatch.setattr(moe_quant_mma, "_gpu_ok", lambda: True)
    monkeypatch.setattr(moe_quant_mma, "_builds", lambda *a: True)
    stream = type("Stream", (), {"__cuda_stream__": lambda self: (0, 0)})()
    codes, scales = fp8_rows(_weight(rng, 24, 256))
    x1, x2 = device(np.zeros((1, 256), np.float32)), device(np.zeros((2, 256), np.float32))
    codes_d, scales_d = device(codes), device(scales)
    assert "attn" in moe_quant_mma.FORMATS  # on by default
    assert linear_quant_mma.takes(x1, codes_d, scales_d, stream)
    monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset({"fp8", "int4"}))
    assert not linear_quant_mma.takes(x1, codes_d, scales_d, stream)
    monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset({"attn"}))
    assert linear_quant_mma.takes(x1, codes_d, scales_d, stream)
    assert not linear_quant_mma.takes(x2, codes_d, scales_d, stream)
    assert not linear_quant_mma.takes(x1, codes_d, scales_d, 0)
    odd, odd_scales = fp8_rows(_weight(rng, 24, 136))
    assert not linear_quant_mma.takes(device(np.zeros((1, 136), np.float32)), device(odd), device(odd_scales), stream)
    launched = []
    monkeypatch.setattr(linear_quant_mma, "launch", lambda *a, **k: launched.append(a) or a[3])
    monkeypatch.setattr(moe_quant_mma, "_stream_object", lambda s: True)
    x = rng.standard_normal((1, 256), dtype=np.float32)
    linear_fp8_cuda(device(x), codes_d, scales_d, poisoned((1, 24)))
    assert len(launched) == 1
    monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset())  # off: the numba kernel, the reference's results
    out = poisoned((1, 24))
    linear_fp8_cuda(device(x), codes_d, scales_d, out)
    np.testing.assert_allclose(out.copy_to_host(), linear_fp8_ref(x, codes, scales), rtol=1e-4,
                               atol=1e-5 * np.abs(linear_fp8_ref(x, codes, scales)).max())
    assert len(launched) == 1


def dense_bound(x, codes, scales):
    """|kernel - exact| per output: x_k within F16_STEP relative in f16, the products exact, f32 sums (1.5 covers
    them and the second order)."""
    w = np.abs(fp8_rows_dequantize(codes, scales).astype(np.float64))
    return 1.5 * F16_STEP * (np.abs(np.asarray(x, np.float64)) @ w.T)


def _case(rng, rows, cols, big=False):
    codes, scales = fp8_rows(_weight(rng, rows, cols))
    x = rng.standard_normal((1, cols), dtype=np.float32)
    if big:  # chunks past f16's range and in its subnormals
        x[0, :64] *= 1e6
        x[0, 64:128] *= 1e-7
    return x, codes, scales


def _within_bound(got, x, codes, scales):
    expected = linear_fp8_ref(x, codes, scales).astype(np.float64)
    excess = np.abs(got.astype(np.float64) - expected) - dense_bound(x, codes, scales) - 1e-6 * np.abs(expected).max()
    assert excess.max() <= 0, (excess.max(), np.abs(got - expected).max())


@pytest.mark.parametrize("rows, cols, big", [(*QKV, False), (*O, False), (*ODD, False), (33, 1040, True)])
def test_the_kernels_arithmetic_is_within_the_f16_bound(rng, rows, cols, big):
    """moe_quant_mma_ref.dense_ref (the GPU tests' tight reference) against the exact product: within dense_bound
    (numpy only: runs in the simulator)."""
    x, codes, scales = _case(rng, rows, cols, big)
    got = moe_quant_mma_ref.dense_ref(x, codes, scales)
    assert np.all(np.isfinite(got))
    _within_bound(got, x, codes, scales)


def _launch(x, codes, scales, shape=None, early=False):
    from moebus.cuda.kernels.compat import cuda

    stream, out = cuda.stream(), poisoned((1, codes.shape[0]))
    held = device(x), device(codes), device(scales)
    linear_quant_mma.launch(*held, out, stream, shape, early)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    return got


def _tight(got, expected):  # f32 sums in another order only
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5 * np.abs(expected).max())


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("rows, cols, big", [(*QKV, False), (*O, False), (*ODD, False), (33, 1040, False),
                                             (*QKV, True), (*ODD, True)])
def test_the_kernel_matches_its_arithmetic_and_the_numba_kernel(rng, monkeypatch, rows, cols, big):
    """Tight against dense_ref; against the exact product and the numba one-round kernel within dense_bound."""
    x, codes, scales = _case(rng, rows, cols, big)
    got = _launch(x, codes, scales)
    assert np.all(np.isfinite(got))
    _tight(got, moe_quant_mma_ref.dense_ref(x, codes, scales))
    _within_bound(got, x, codes, scales)
    monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset())
    numba = poisoned((1, rows))
    linear_fp8_cuda(device(x), device(codes), device(scales), numba)
    numba = numba.copy_to_host()
    slack = dense_bound(x, codes, scales) + 1e-5 * np.abs(numba).max()
    assert np.all(np.abs(got.astype(np.float64) - numba) <= slack)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("rows, cols, shape", [*((*QKV, s) for s in linear_quant_mma.SWEEP[2048]),
                                               *((*O, s) for s in linear_quant_mma.SWEEP[4096])])
def test_every_swept_shape_matches_its_arithmetic(rng, rows, cols, shape):
    x, codes, scales = _case(rng, rows, cols)
    _tight(_launch(x, codes, scales, shape), moe_quant_mma_ref.dense_ref(x, codes, scales, shape))


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_the_early_kernel_gives_the_same_bits(rng):
    """The weights read before the wait (linear_quant_mma.LOAD_BEFORE_WAIT): the same sums in the same order."""
    x, codes, scales = _case(rng, *ODD)
    np.testing.assert_array_equal(_launch(x, codes, scales, early=False), _launch(x, codes, scales, early=True))


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_decode_with_the_attention_option_gives_the_same_greedy_tokens(micro_model, monkeypatch):  # noqa: F811
    """bf16 experts, FP8 attention: the decode steps' projections through this kernel (counted) give the tokens of
    the numba kernel, log p close (x in f16)."""
    decode_on_and_off(micro_model, "bf16", {"attn"}, linear_quant_mma, monkeypatch, attention="fp8")


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_decode_with_every_option_gives_the_same_greedy_tokens(micro_fp8_model, monkeypatch):  # noqa: F811
    """fp8 experts (half resident) and FP8 attention, MOEBUS_QUANT_MMA=all's set."""
    decode_on_and_off(micro_fp8_model, "fp8", moe_quant_mma.NAMES, linear_quant_mma, monkeypatch, attention="fp8")
