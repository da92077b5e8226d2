"""moe_quant_mma.FIXED_OFFSETS (nineteenth session): the expert layout's matrix offsets compiled into the tensor-core
GEMVs. The shapes it opens compile without spills (where the NVRTC wheel is installed); on a GPU (MOEBUS_TEST_GPU=1)
they match the reference within the f16 bound, and the offsets compiled in give the bits of the offsets passed."""
import numpy as np
import pytest

from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.kernels import moe_quant_mma
from moebus.cuda.kernels.compat import SIMULATOR
from tests.cuda.conftest import device, poisoned
from tests.cuda.test_moe_quant import _arena
from tests.cuda.test_moe_quant_mma import _check, _nvrtc


@pytest.mark.parametrize("mats, shape", [*((2, s) for s in moe_quant_mma.FIXED_GATE_UP_SWEEP[1:]),
                                         (1, moe_quant_mma.DOWN_SHAPE)])
def test_the_layouts_offsets_compiled_in_spill_nothing(mats, shape, monkeypatch):
    """FIXED_OFFSETS: the A3B fp8 matrices' offsets compiled in; the shapes it opens have no spills."""
    _nvrtc()
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    monkeypatch.setattr(moe_quant_mma, "FIXED_OFFSETS", True)
    layout = ExpertLayout("fp8", 2048, 768)
    cols, rows = (2048, 768) if mats == 2 else (768, 2048)
    options = moe_quant_mma.compile_options("sm_90", cols, rows, mats, shape, mats == 1, "fp8", False,
                                            moe_quant_mma._fixed(layout, mats))
    assert b"-DCODE0=" in b" ".join(options)
    cubin, log = nvrtc_compile(moe_quant_mma.source(), options + [b"--ptxas-options=-v"], target="cubin")
    assert cubin
    if log.strip():
        lines = log.splitlines()
        at = next(i for i, line in enumerate(lines) if "entry function" in line)
        assert " 0 bytes spill stores" in lines[at + 2], lines[at + 2]


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("gate_up_shape", moe_quant_mma.FIXED_GATE_UP_SWEEP)
def test_the_offsets_compiled_in_match_the_reference(rng, monkeypatch, gate_up_shape):
    """FIXED_OFFSETS: the shapes mma19_bench.py times with it, and the default down kernel."""
    monkeypatch.setattr(moe_quant_mma, "FIXED_OFFSETS", True)
    layout = ExpertLayout("fp8", 2048, 768)
    _check(rng, layout, rng.standard_normal((1, 2048), dtype=np.float32), gate_up_shape, None)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_the_offsets_compiled_in_give_the_same_bits(rng, monkeypatch, fmt):
    """The same sums in the same order whether the offsets come from the launch or the compiler."""
    from moebus.cuda.kernels.compat import cuda

    layout = ExpertLayout(fmt, 256, 128)
    arena = device(_arena(rng, layout))
    x = device(rng.standard_normal((1, 256), dtype=np.float32))
    token, slot, pair_out = (device(np.array(c, np.int32)) for c in ([0, 0], [1, 2], [1, 0]))
    results = []
    for fixed in (False, True):
        monkeypatch.setattr(moe_quant_mma, "FIXED_OFFSETS", fixed)
        out, h, stream = poisoned((2, 256)), poisoned((2, 128)), cuda.stream()
        moe_quant_mma.launch(x, token, slot, pair_out, arena, arena, layout, h, out, stream)
        results.append(out.copy_to_host(stream=stream))
        stream.synchronize()
    np.testing.assert_array_equal(results[0], results[1])
