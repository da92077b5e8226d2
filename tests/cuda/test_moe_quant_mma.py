"""The fp8 expert GEMVs on tensor cores (moe_quant_mma.py, MOEBUS_QUANT_MMA): compiled by NVRTC for sm_90 without
spills and waiting first (where the NVRTC wheel is installed); the choice in expert_ffn_quant_cuda (simulator);
on a GPU (MOEBUS_TEST_GPU=1) against the numpy reference within the bound that x (and h) in f16 gives, at shapes
with partial tiles, steps and scale blocks, a host-store miss, x beyond f16's range, every shape the bench sweeps;
and a decode with the option on giving the greedy tokens of the option off."""
import numpy as np
import pytest

from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.kernels import moe_quant, moe_quant_mma, moe_quant_mma_ref
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.elementwise import silu_ref
from moebus.cuda.kernels.moe_quant import expert_ffn_quant_ref
from tests.cuda.conftest import device, poisoned
from tests.cuda.test_moe_quant import _arena, _close, _run
from tests.cuda.test_quant_e2e import micro_fp8_model  # noqa: F401 - the module's fixture

F16_STEP = 2.0**-11  # x rounded to f16 (after a power of two): relative error at most half an ulp of 11 bits


def _nvrtc():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - the library itself is missing
        pytest.skip(f"NVRTC not installed: {exc}")


def _compile(cols, rows, mats, shape, early=False, target="cubin", fmt="fp8", dense=False, route=0):
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    arch = "sm_90" if target == "cubin" else "compute_90"
    extra = [b"--ptxas-options=-v"] if target == "cubin" else []
    options = moe_quant_mma.compile_options(arch, cols, rows, mats, shape, early, fmt, dense, route)
    return nvrtc_compile(moe_quant_mma.source(), options + extra, target=target)


def spill_stores(log, entry: str) -> int:
    """The bytes of spill stores ptxas -v reports for ``entry`` (0 where it printed nothing)."""
    if not log.strip():
        return 0
    lines = log.splitlines()
    at = next(i for i, line in enumerate(lines) if f"entry function '{entry}'" in line)
    return int(lines[at + 2].split(" bytes spill stores")[0].rsplit(",", 1)[-1])


# (format, matrices, shape): the spill stores ptxas may report; int4 (1, 8, 1, 4): 4 bytes with the H200 machine's
# NVRTC (CUDA 13.0; 0 with 13.5), the twenty-second and twenty-third sessions' device runs (its decode figures with it)
SPILL_BYTES = {("fp8", 2, (1, 8, 2, 3)): 4, ("int4", 2, (1, 8, 1, 4)): 4}


@pytest.mark.parametrize("cols, rows, mats, shape, early, fmt", [
    (2048, 768, 2, moe_quant_mma.GATE_UP_SHAPE, False, "fp8"),  # A3B gate|up
    (768, 2048, 1, moe_quant_mma.DOWN_SHAPE, True, "fp8"),  # A3B down, its codes before the wait
    (768, 2048, 1, moe_quant_mma.DOWN_SHAPE, False, "fp8"),
    (144, 48, 2, moe_quant_mma.GATE_UP_SHAPE, False, "fp8"),  # partial steps, tiles and scale blocks
    (2048, 768, 2, moe_quant_mma.INT4_GATE_UP_SHAPE, False, "int4"),
    (768, 2048, 1, moe_quant_mma.INT4_DOWN_SHAPE, True, "int4"),
])
def test_kernels_compile_for_hopper_without_spills(cols, rows, mats, shape, early, fmt):
    """No spills but the fp8 gate|up default's 4 bytes ((1, 8, 2, 3): a value on L1's stack; the decode's fastest)."""
    _nvrtc()
    entry = moe_quant_mma.GATE_UP_ENTRY if mats == 2 else moe_quant_mma.DOWN_ENTRY
    ptx, _ = _compile(cols, rows, mats, shape, early, "ptx", fmt)
    assert f".entry {entry}".encode() in ptx and b"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert (b"cvt.rn.f16x2.e4m3x2" in ptx) == (fmt == "fp8")
    cubin, log = _compile(cols, rows, mats, shape, early, fmt=fmt)
    assert cubin
    assert spill_stores(log, entry) <= SPILL_BYTES.get((fmt, mats, tuple(shape)), 0), log


@pytest.mark.parametrize("mats, early", [(2, False), (1, False), (1, True)])
def test_the_kernels_wait_before_reading_what_the_step_wrote(mats, early):
    """griddepcontrol.wait before any global read (early: only the pair tables and the codes, ld.global.cs, before
    it; never x or h), then the trigger where pdl.trigger_after_wait: the numba kernels' rule (pdl.py)."""
    _nvrtc()
    cols, rows = (256, 128) if mats == 2 else (128, 256)
    shape = moe_quant_mma.GATE_UP_SHAPE if mats == 2 else moe_quant_mma.DOWN_SHAPE
    ptx, _ = _compile(cols, rows, mats, shape, early, "ptx")
    assert_waits_first(ptx, early)


def assert_waits_first(ptx: bytes, early: bool) -> None:
    """griddepcontrol.wait before any global read or write; ``early``: only the weights' streamed 16-byte loads
    (ld.global.cs) before it, never x; then the trigger where pdl.trigger_after_wait."""
    from moebus.cuda.kernels import pdl

    at = ptx.index(b"griddepcontrol.wait")
    before = ptx[:at]
    if early:
        assert b"ld.global.cs.v4.u32" in before and b"ld.global.v4.f32" not in before and b"st.global" not in before
    else:
        assert not any(op in before for op in (b"ld.global", b"st.global", b"atom.")), before[-400:]
    assert (b"griddepcontrol.launch_dependents" in ptx[at:]) == pdl.trigger_after_wait()


def test_the_switch_names_the_formats(monkeypatch):
    assert moe_quant_mma._formats("0") == moe_quant_mma._formats("") == frozenset()
    assert moe_quant_mma._formats("1") == moe_quant_mma._formats("fp8") == {"fp8"}
    assert moe_quant_mma._formats("fp8,int4") == {"fp8", "int4"}
    assert moe_quant_mma._formats("all") == {"fp8", "int4", "attn"}  # attn: linear_quant_mma.py
    assert moe_quant_mma._formats("int4") == {"int4"}
    with pytest.raises(ValueError):
        moe_quant_mma._formats("bf16")


def test_expert_ffn_takes_them_only_with_the_option(rng, monkeypatch):
    """MOEBUS_QUANT_MMA on (the default, every format); off: the numba kernels even where the GPU could; fp8: fp8 at
    batch 1 with a stream object, not int4 (its own format in the switch), runs of two pairs or the default stream."""
    layout = ExpertLayout("fp8", 256, 128)
    arena = device(_arena(rng, layout, 2))
    monkeypatch.setattr(moe_quant_mma, "_gpu_ok", lambda: True)
    monkeypatch.setattr(moe_quant_mma, "_builds", lambda *a: True)
    stream = type("Stream", (), {"__cuda_stream__": lambda self: (0, 0)})()
    assert moe_quant_mma.FORMATS == {"fp8", "int4", "attn"}  # on by default
    monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset())
    assert not moe_quant_mma.takes(layout, 1, arena, arena, stream)
    monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset({"fp8"}))
    assert moe_quant_mma.takes(layout, 1, arena, arena, stream)
    assert not moe_quant_mma.takes(layout, 2, arena, arena, stream)
    assert not moe_quant_mma.takes(layout, 1, arena, arena, 0)
    int4 = ExpertLayout("int4", 256, 128)
    assert not moe_quant_mma.takes(int4, 1, arena, arena, stream)
    monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset({"fp8", "int4"}))
    assert moe_quant_mma.takes(int4, 1, arena, arena, stream)
    assert not moe_quant_mma.takes(ExpertLayout("int4", 272, 128), 1, arena, arena, stream)  # 8.5 words a row
    launched = []
    monkeypatch.setattr(moe_quant_mma, "launch", lambda *a, **k: launched.append(a))
    monkeypatch.setattr(moe_quant_mma, "_stream_object", lambda s: True)
    x = rng.standard_normal((1, 256), dtype=np.float32)
    pairs = [(0, 1, 0), (0, 0, 1)]
    _run(x, pairs, arena, layout, poisoned((2, 256)))
    assert len(launched) == 1
    monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset())  # off: the numba kernels, the reference's results
    out, expected = poisoned((2, 256)), np.full((2, 256), np.nan, np.float32)
    _run(x, pairs, arena, layout, out)
    expert_ffn_quant_ref(x, *np.array(pairs, np.int32).T, arena.copy_to_host(), layout, expected)
    _close(out.copy_to_host(), expected)
    assert len(launched) == 1


def f16_bound(x, pairs, arena, layout, store=None):
    """A bound on |kernel - exact| per output element: x_k and h_k each within F16_STEP relative in f16, the
    products exact, f32 sums (a factor 1.5 over the first-order terms covers them and the second order)."""
    x = np.asarray(x, np.float64)
    bounds = []
    for token, slot, _ in pairs:
        blob = np.asarray(arena[slot] if slot >= 0 else store[-1 - slot])
        gate, up, down = (np.asarray(m, np.float64) for m in layout.dequantize(blob))
        gate_q, up_q, down_q = _rounded_parts(layout, blob)
        xs = x[token]
        g, u = gate @ xs, up @ xs
        eg, eu = F16_STEP * (gate_q @ np.abs(xs)), F16_STEP * (up_q @ np.abs(xs))
        h = silu_ref(g.astype(np.float32)).astype(np.float64) * u
        sig = 1.0 / (1.0 + np.exp(-g))
        slope = np.abs(sig * (1.0 + g * (1.0 - sig)))  # silu'(g)
        eh = 1.5 * ((slope + 0.5 * eg) * eg * (np.abs(u) + eu) + np.abs(silu_ref(g.astype(np.float32))) * eu)
        bounds.append(1.5 * (down_q @ (eh + F16_STEP * (np.abs(h) + eh))))
    return np.array(bounds)


def _rounded_parts(layout, blob):
    """|the part of each weight that multiplies x in f16|: fp8 |w|; int4 |q s| (m sum x is summed in f32)."""
    from moebus.common.quant import int4_codes

    if layout.dtype == "fp8":
        return tuple(np.abs(np.asarray(m, np.float64)) for m in layout.dequantize(blob))
    out = []
    for codes, params in layout.parts(blob):
        cols = 2 * codes.shape[1]
        scale = np.repeat(params[:, :, 0], 128, axis=1)[:, :cols]
        out.append(np.abs(int4_codes(codes, cols) * scale).astype(np.float64))
    return tuple(out)


def _tight(got, expected):
    # the kernel against its arithmetic in numpy (moe_quant_mma_ref.gemv_ref): f32 sums in another order only
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5 * np.abs(expected).max())


def _check(rng, layout, x, gate_up_shape, down_shape, store_rows=2):
    """The kernels on three pairs (slot 2, host-store row 1: a miss, slot 0): h against gemv_ref's, the output
    against gemv_ref of the kernel's own h, and against expert_ffn_quant_ref within f16_bound."""
    from moebus.cuda.kernels.compat import cuda

    arena, store = _arena(rng, layout), _arena(rng, layout, store_rows)
    pairs = [(0, 2, 1), (0, -2, 0), (0, 0, 2)]
    token, slot, pair_out = (device(np.ascontiguousarray(c, np.int32)) for c in np.array(pairs).T)
    out, h = poisoned((3, layout.hidden)), poisoned((3, layout.inter))
    stream = cuda.stream()
    on_device = device(x), device(arena), device(store)  # held until the kernels are done
    gate_up_shape = gate_up_shape or moe_quant_mma.shapes(layout.dtype)[0]
    down_shape = down_shape or moe_quant_mma.shapes(layout.dtype)[1]
    moe_quant_mma.launch(on_device[0], token, slot, pair_out, *on_device[1:], layout, h, out, stream, gate_up_shape,
                         down_shape, early=False)
    got, got_h = out.copy_to_host(stream=stream), h.copy_to_host(stream=stream)
    stream.synchronize()
    with np.errstate(over="ignore"):
        emulated_h, _ = moe_quant_mma_ref.expert_ffn_mma_ref(x, pairs, arena, layout, store, gate_up_shape, down_shape)
        _tight(got_h, emulated_h)
        gemv = moe_quant_mma_ref.gemv_ref if layout.dtype == "fp8" else moe_quant_mma_ref.gemv_int4_ref
        for j, (_, s, o) in enumerate(pairs):
            _, _, (down, down_s) = layout.parts(arena[s] if s >= 0 else store[-1 - s])
            _tight(got[o], gemv(got_h[j], down, down_s, tuple(down_shape)))
        expected = np.full((3, layout.hidden), np.nan, np.float32)
        expert_ffn_quant_ref(x, *np.array(pairs, np.int32).T, arena, layout, expected, store=store)
        bound = f16_bound(x, pairs, arena, layout, store)[np.argsort([p[2] for p in pairs])]
    assert np.all(np.isfinite(got))
    excess = np.abs(got.astype(np.float64) - expected) - bound - 1e-6 * np.abs(expected).max()
    assert excess.max() <= 0, (excess.max(), np.abs(got - expected).max(), bound.max())
    return got, expected


@pytest.mark.parametrize("fmt, hidden, inter, big", [("fp8", 256, 128, False), ("fp8", 144, 48, False),
                                                     ("fp8", 1040, 32, False), ("fp8", 256, 128, True),
                                                     ("int4", 256, 128, False), ("int4", 160, 64, False),
                                                     ("int4", 256, 128, True)])
def test_the_kernels_arithmetic_is_within_the_f16_bound(rng, fmt, hidden, inter, big):
    """moe_quant_mma_ref.expert_ffn_mma_ref (the GPU tests' tight reference) against expert_ffn_quant_ref: within
    f16_bound (numpy only: runs in the simulator)."""
    layout = ExpertLayout(fmt, hidden, inter)
    arena, store = _arena(rng, layout), _arena(rng, layout, 2)
    x = rng.standard_normal((1, hidden), dtype=np.float32)
    if big:  # chunks past f16's range and in its subnormals
        x[0, :64] *= 1e6
        x[0, 128:192] *= 1e-7
    pairs = [(0, 2, 1), (0, -2, 0), (0, 0, 2)]
    with np.errstate(over="ignore"):
        _, out = moe_quant_mma_ref.expert_ffn_mma_ref(x, pairs, arena, layout, store)
        expected = np.full((3, hidden), np.nan, np.float32)
        expert_ffn_quant_ref(x, *np.array(pairs, np.int32).T, arena, layout, expected, store=store)
        bound = f16_bound(x, pairs, arena, layout, store)
    rows = [p[2] for p in pairs]
    assert np.all(np.abs(out.astype(np.float64) - expected[rows]) <= bound + 1e-6 * np.abs(expected).max())


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("fmt, hidden, inter", [
    ("fp8", 256, 128),   # whole tiles, steps and scale blocks
    ("fp8", 144, 48),    # a partial step (144 = 2 x 64 + 16) and scale block along D; down: 9 tiles, a partial block
    ("fp8", 1040, 32),   # 17 steps (the last partial) a gate|up row; down: rows of one partial step, 65 tiles
    ("fp8", 2048, 768),  # A3B
    ("int4", 256, 128),
    ("int4", 160, 64),   # int4: a partial group (160 = 128 + 32) along D; down: rows of half a step, 10 tiles
    ("int4", 2048, 768),
])
def test_kernels_match_the_reference_within_the_f16_bound(rng, fmt, hidden, inter):
    layout = ExpertLayout(fmt, hidden, inter)
    x = rng.standard_normal((1, hidden), dtype=np.float32)
    got, expected = _check(rng, layout, x, None, None)
    assert np.abs(got - expected).max() < 5e-3 * np.abs(expected).max()  # numpy's f16 emulation: ~4.5e-4


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("fmt, gate_up_shape, down_shape", [
    *(("fp8", *pair) for pair in zip(moe_quant_mma.GATE_UP_SWEEP, moe_quant_mma.DOWN_SWEEP)),
    *(("int4", *pair) for pair in zip(moe_quant_mma.INT4_GATE_UP_SWEEP, moe_quant_mma.INT4_DOWN_SWEEP))])
def test_every_swept_shape_matches_the_reference(rng, fmt, gate_up_shape, down_shape):
    layout = ExpertLayout(fmt, 2048, 768)
    _check(rng, layout, rng.standard_normal((1, 2048), dtype=np.float32), gate_up_shape, down_shape)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_x_beyond_the_range_of_f16_neither_overflows_nor_flushes(rng, fmt):
    """Chunks of x near 1e6 (past f16's 65504: h may be that large) and near 1e-7 (f16's subnormals): each chunk
    has its own power of two."""
    layout = ExpertLayout(fmt, 256, 128)
    x = rng.standard_normal((1, 256), dtype=np.float32)
    x[0, :64] *= 1e6
    x[0, 128:192] *= 1e-7
    with np.errstate(over="ignore"):  # silu of -1e7 in the reference: exp overflows to inf, silu to -0 (as expf)
        _check(rng, layout, x, None, None)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_the_early_down_kernel_gives_the_same_bits(rng):
    """The down GEMV reading its codes before the wait (moe_quant_round.DOWN_LOAD_BEFORE_WAIT's rule) computes the
    same sums in the same order."""
    from moebus.cuda.kernels.compat import cuda

    layout = ExpertLayout("fp8", 256, 128)
    arena = device(_arena(rng, layout))
    x = device(rng.standard_normal((1, 256), dtype=np.float32))
    token, slot, pair_out = (device(np.array(c, np.int32)) for c in ([0, 0], [1, 2], [1, 0]))
    results = []
    for early in (False, True):
        out, h, stream = poisoned((2, 256)), poisoned((2, 128)), cuda.stream()
        moe_quant_mma.launch(x, token, slot, pair_out, arena, arena, layout, h, out, stream, early=early)
        results.append(out.copy_to_host(stream=stream))
        stream.synchronize()
    np.testing.assert_array_equal(results[0], results[1])


@pytest.fixture(scope="module")
def micro_wide_model(tmp_path_factory):
    """The micro model with rows of whole int4 words (intermediate 32; bf16, quantized at load)."""
    from tests.cuda.test_e2e import init_micro

    return init_micro(tmp_path_factory, "micro_wide", moe_intermediate_size=32)


def decode_on_and_off(model, experts, formats, counted, monkeypatch, attention="bf16"):
    """A micro model's greedy decode (half its cache resident) with MOEBUS_QUANT_MMA off, then ``formats``: the
    launches of ``counted`` (a module with ``launch``) happen only with them on; the same tokens, log p close."""
    from moebus.workers.local import LocalModel

    prompt = [5, 17, 42, 9, 77]
    runs, calls = {}, []
    real = counted.launch
    monkeypatch.setattr(counted, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(moe_quant_mma, "FORMATS", frozenset(formats if on else ()))
        runs[on] = LocalModel(model, device="cuda", max_context=32, cache_fraction=0.5, experts_dtype=experts,
                              attention_dtype=attention).generate(prompt, 4)
        assert bool(calls) == on
    assert runs[True].tokens == runs[False].tokens
    np.testing.assert_allclose(runs[True].logprobs, runs[False].logprobs, atol=2e-3)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_decode_with_the_option_gives_the_same_greedy_tokens(micro_fp8_model, monkeypatch):  # noqa: F811
    """fp8 experts, half resident (misses read the host store): the decode steps through these kernels (counted)
    give the tokens of the numba kernels, log p close (x and h in f16)."""
    decode_on_and_off(micro_fp8_model, "fp8", {"fp8"}, moe_quant_mma, monkeypatch)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_int4_decode_with_the_option_gives_the_same_greedy_tokens(micro_wide_model, monkeypatch):
    decode_on_and_off(micro_wide_model, "int4", {"int4"}, moe_quant_mma, monkeypatch)
