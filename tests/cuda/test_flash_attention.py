"""The fused (flash) attention: its tiled numpy reference (the kernel's index math: query and key
tiles, causal and sliding-window key ranges, GQA, segments, images) against attention_ref and
vision_attention_ref on CPU; the .cu compiled by NVRTC to a cubin without spills (when the NVRTC
wheel is installed); and on a GPU (MOEBUS_TEST_GPU=1) the kernel itself against both references."""
import numpy as np
import pytest

from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels.attention import attention_ref
from moebus.cuda.kernels import flash_attention
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.dtypes import bf16_to_f32
from moebus.cuda.kernels.flash_attention_ref import (flash_images_ref, flash_prefill_ref, key_range, split_planes_ref,
                                                     tile_keys)
from moebus.cuda.kernels.vision_attention import vision_attention_ref

# (first row, slot, start, length): a chunk after 50 positions of context that crosses a query tile,
# a fresh prompt of a few tokens, a chunk of one tile exactly
SEGMENTS = [(0, 1, 50, 70), (70, 0, 0, 5), (75, 2, 3, 64)]
TOKENS, SLOTS, CONTEXT = 139, 3, 128


def _prefill_inputs(rng, heads: int, kv_heads: int, head_dim: int, bf16: bool):
    q = rng.standard_normal((TOKENS, heads, head_dim), dtype=np.float32)
    caches = []
    for _ in range(2):
        cache = np.full((SLOTS, kv_heads, CONTEXT, head_dim), np.nan, np.float32)  # unwritten rows: NaN
        for _, slot, start, length in SEGMENTS:
            cache[slot, :, :start + length] = rng.standard_normal((kv_heads, start + length, head_dim))
        caches.append(f32_to_bf16(cache) if bf16 else cache)
    slot_of, pos_of = np.zeros(TOKENS, np.int32), np.zeros(TOKENS, np.int32)
    for row0, slot, start, length in SEGMENTS:
        slot_of[row0:row0 + length], pos_of[row0:row0 + length] = slot, start + np.arange(length)
    return q, caches[0], caches[1], slot_of, pos_of


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("bf16", [True, False])
def test_prefill_ref_matches_attention_ref(rng, window, bf16):
    q, k, v, slot_of, pos_of = _prefill_inputs(rng, 4, 2, 16, bf16)
    want = attention_ref(q, k, v, slot_of, pos_of, 0.25, window)
    got = flash_prefill_ref(q, k, v, SEGMENTS, 0.25, window)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=3e-5)


@pytest.mark.parametrize("head_dim", [8, 88])  # 88: float32 keys of 96 padded dims, tiles of 32 keys
def test_images_ref_matches_vision_attention_ref(rng, head_dim):
    images, positions, heads = 2, 70, 2
    q, k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(3))
    scale = head_dim ** -0.5
    np.testing.assert_allclose(flash_images_ref(q, k, v, images, scale), vision_attention_ref(q, k, v, images, scale),
                               rtol=1e-4, atol=3e-5)


@pytest.mark.parametrize("precision,atol", [("split_scores", 3e-3), ("bf16", 1e-2)])
def test_images_ref_with_plain_bf16_products_stays_near_vision_attention_ref(rng, precision, atol):
    """The plain bf16 products round q, k (and p, v) to 8 bits: ~2^-9 relative per operand, so the
    outputs (O(1) here) move by ~1e-3, far more than the split products' ~1e-6, and no more."""
    images, positions, heads, head_dim = 2, 70, 2, 72
    q, k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(3))
    want = vision_attention_ref(q, k, v, images, head_dim ** -0.5)
    split = np.abs(flash_images_ref(q, k, v, images, head_dim ** -0.5) - want).max()
    plain = np.abs(flash_images_ref(q, k, v, images, head_dim ** -0.5, precision) - want).max()
    assert split < 3e-5 and 10 * split < plain < atol


def test_a_bad_image_precision_is_refused(monkeypatch):
    from moebus.cuda.kernels import flash_attention

    monkeypatch.setattr(flash_attention, "IMAGE_PRECISION", "fp8")
    with pytest.raises(ValueError, match="MOEBUS_IMAGE_ATTENTION"):
        flash_attention.ready(72, True)
    with pytest.raises(ValueError, match="one of split, split_scores, bf16"):
        flash_attention.compile_options(72, True, "sm_90", 8, "tf32")


def test_key_ranges():
    assert tile_keys(128, False) == 64 and tile_keys(72, True) == 32 and tile_keys(88, True) == 32
    assert tile_keys(16, True) == 64 and tile_keys(72, True, "bf16") == 64 and tile_keys(72, True, "split_scores") == 32
    assert tile_keys(72, True, stages_wanted=1) == 64 and tile_keys(128, True) == 32
    assert key_range(0, 63, 500, 300, 0, True, 64) == (0, 364)  # causal: context then the tile's own keys
    assert key_range(64, 69, 370, 300, 0, True, 64) == (0, 370)
    assert key_range(64, 127, 500, 300, 100, True, 64) == (256, 428)  # window: first seen key 265
    assert key_range(0, 63, 70, 0, 0, False, 64) == (0, 70)  # an image: every key


def test_planes_hold_each_images_keys_and_values_split_and_padded(rng):
    images, positions, heads, head_dim = 2, 70, 3, 72
    k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(2))
    k_planes, v_planes = split_planes_ref(k, v, images)
    assert k_planes.shape == (2, 3, 2, 128, 80) and v_planes.shape == (2, 3, 2, 72, 128)  # keys to 64s, dims to 16s
    keys = bf16_to_f32(k_planes[..., :positions, :head_dim]).sum(axis=2)  # hi + lo, (images, heads, P, hd)
    values = bf16_to_f32(v_planes[..., :positions]).sum(axis=2).transpose(0, 1, 3, 2)
    for got, want in ((keys, k), (values, v)):
        want = want.reshape(images, positions, heads, head_dim).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(got, want, rtol=2 ** -16, atol=0)
    assert not k_planes[..., positions:, :].any() and not k_planes[..., head_dim:].any()
    assert not v_planes[..., positions:].any()


def _nvrtc():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        nvrtc.nvrtcVersion()
    except Exception as exc:  # the library itself is missing (no nvidia-cuda-nvrtc wheel, no toolkit)
        pytest.skip(f"NVRTC not installed: {exc}")


@pytest.mark.parametrize("head_dim,f32_kv", [(128, False), (72, True), (8, True), (128, True), (40, False)])
def test_kernel_compiles_for_hopper_without_spills(head_dim, f32_kv):
    _nvrtc()
    from moebus.cuda.kernels.flash_attention import compile_options, nvrtc_compile, source

    options = compile_options(head_dim, f32_kv, "compute_90")
    ptx, _ = nvrtc_compile(source(), options, target="ptx")
    assert b"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and b".entry flash_attention" in ptx
    assert b".entry split_planes" in ptx and b".entry rope_planes" in ptx
    for warps in (4, 8) if f32_kv else (4,):
        options = compile_options(head_dim, f32_kv, "sm_90", warps) + [b"--ptxas-options=-v"]
        cubin, log = nvrtc_compile(source(), options)
        assert cubin and log.count(" 0 bytes spill stores") == 3, log  # every entry


@pytest.mark.parametrize("head_dim", [72, 16, 128])
def test_rope_planes_by_pairs_compile_without_spills(head_dim):
    _nvrtc()
    from moebus.cuda.kernels.flash_attention import compile_options, nvrtc_compile, source

    options = compile_options(head_dim, True, "sm_90", 8, defines=(("ROPE_PAIRS", 1),)) + [b"--ptxas-options=-v"]
    cubin, log = nvrtc_compile(source(), options)
    assert cubin and log.count(" 0 bytes spill stores") == 3, log


@pytest.mark.parametrize("head_dim", [72, 128])
@pytest.mark.parametrize("precision", ["split_scores", "bf16"])
def test_image_kernel_with_plain_bf16_products_compiles_without_spills(head_dim, precision):
    _nvrtc()
    from moebus.cuda.kernels.flash_attention import compile_options, nvrtc_compile, source

    split_ptx, _ = nvrtc_compile(source(), compile_options(head_dim, True, "compute_90", 8), target="ptx")
    ptx, _ = nvrtc_compile(source(), compile_options(head_dim, True, "compute_90", 8, precision), target="ptx")
    mma = b"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    assert 0 < ptx.count(mma) < split_ptx.count(mma)  # fewer products on the tensor cores
    options = compile_options(head_dim, True, "sm_90", 8, precision) + [b"--ptxas-options=-v"]
    cubin, log = nvrtc_compile(source(), options)
    assert cubin and log.count(" 0 bytes spill stores") == 3, log


@pytest.mark.parametrize("head_dim,precision,defines,stages", [
    (72, "split", (), 2),  # two tiles of 64 split keys and values pass 48 KiB: two of 32
    (72, "split", (("STAGES_WANTED", 1),), 1),
    (72, "split", (("TILE_KEYS", 64),), 1),
    (128, "split", (), 1),  # two tiles of 32 pass 48 KiB
    (16, "split", (), 2),
    (72, "bf16", (), 2),
    (72, "bf16", (("STAGES_WANTED", 1),), 1),
    (72, "bf16", (("MIN_BLOCKS", 2),), 2),
])
def test_images_copy_the_next_tile_while_computing_where_two_fit(head_dim, precision, defines, stages):
    """(Spills are checked where each build is first compiled: on the H200 NVRTC printed no ptxas
    report for a build it had compiled before in the process, and ptxas 13.x there spilled 36
    bytes at MIN_BLOCKS 2 where this one spills none.)"""
    _nvrtc()
    from moebus.cuda.kernels.flash_attention import compile_options, nvrtc_compile, source

    options = compile_options(head_dim, True, "compute_90", 8, precision, defines)
    ptx, _ = nvrtc_compile(source(), options, target="ptx")
    assert (b"cp.async.cg.shared.global" in ptx) == (stages == 2)
    assert b"cp.async.wait_group" in ptx if stages == 2 else b"cp.async" not in ptx


@pytest.mark.parametrize("head_dim,defines,k8", [(72, (), 3 * 32 // 8), (72, (("HALF_KSTEP", 0),), 0), (64, (), 0)])
def test_a_head_dim_on_half_a_k_step_ends_q_k_on_k8_products(head_dim, defines, k8):
    """hd 72 (the towers'): the last 8 dims of Q K^T on m16n8k8 (the three split products of each
    n-tile of a 32-key tile), not on m16n8k16 over 8 dims of zero padding; HALF_KSTEP 0 turns it off."""
    _nvrtc()
    from moebus.cuda.kernels.flash_attention import compile_options, nvrtc_compile, source

    ptx, _ = nvrtc_compile(source(), compile_options(head_dim, True, "compute_90", 8, "split", defines), target="ptx")
    assert ptx.count(b"mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32") == k8


@pytest.mark.parametrize("head_dim,precision", [(72, "split"), (16, "split"), (72, "bf16")])
def test_thirty_two_rows_a_warp_feed_each_fragment_read_to_two_mma(head_dim, precision):
    """WARP_ROWS 32 (two m-tiles a warp): twice the mma of a tile for the same shared-memory reads of
    its keys and values (the planes' fragments), the same copies of the tiles."""
    _nvrtc()
    from moebus.cuda.kernels.flash_attention import compile_options, nvrtc_compile, source

    def counts(rows: int) -> tuple[int, int, int]:
        ptx, _ = nvrtc_compile(source(), compile_options(head_dim, True, "compute_90", 4, precision, (), rows),
                               target="ptx")
        return (ptx.count(b"mma.sync.aligned.m16n8k16") + ptx.count(b"mma.sync.aligned.m16n8k8"),
                ptx.count(b"ld.shared.u32") + ptx.count(b"ld.shared.b32"), ptx.count(b"cp.async.cg.shared.global"))

    (mma16, reads16, copies16), (mma32, reads32, copies32) = counts(16), counts(32)
    assert mma32 == 2 * mma16 and reads32 == reads16 > 0 and copies32 == copies16


def test_thirty_two_rows_a_warp_are_for_float32_keys_of_up_to_96_dims(monkeypatch):
    from moebus.cuda.kernels import flash_attention

    for head_dim, f32_kv in ((128, True), (72, False)):
        with pytest.raises(ValueError, match="32 query rows"):
            flash_attention.compile_options(head_dim, f32_kv, "sm_90", 4, "split", (), 32)
    monkeypatch.setattr(flash_attention, "IMAGE_WARP_ROWS", 32)
    monkeypatch.setattr(flash_attention, "IMAGE_WARPS", 4)
    assert flash_attention.block_queries(72, True) == 128  # the launch's grid: 4 warps of 32 queries
    assert flash_attention.block_queries(128, True) == 64  # the .cu has 16 rows a warp there
    assert flash_attention.block_queries(72, False) == flash_attention.BLOCK_QUERIES  # prefill: unchanged
    _nvrtc()
    with pytest.raises(RuntimeError, match="WARP_ROWS"):
        flash_attention.nvrtc_compile(flash_attention.source(), [b"--gpu-architecture=compute_90", b"-DHEAD_DIM=128",
                                                                 b"-DF32_KV=1", b"-DWARP_ROWS=32"], target="ptx")


def test_compiling_leaves_the_interpreters_shared_bytes_alone():
    """NVRTC fills the buffers it is given: an empty log is one byte, and b" " * 1 is CPython's one
    shared b" " (once overwritten, every b" " in the process reads b"\\0": JSON headers broke)."""
    _nvrtc()
    from moebus.cuda.kernels.flash_attention import compile_options, nvrtc_compile, source

    _, log = nvrtc_compile(source(), compile_options(16, False, "sm_90"))
    assert log == "" and b" " * 1 == bytes([32]) and b" ".join([b"a", b"b"]) == b"a b"


def test_bad_head_dim_is_refused_at_compile_time():
    _nvrtc()
    from moebus.cuda.kernels.flash_attention import nvrtc_compile, source

    with pytest.raises(RuntimeError, match="HEAD_DIM"):
        nvrtc_compile(source(), [b"--gpu-architecture=compute_90", b"-DF32_KV=0"], target="ptx")


def test_cubin_is_compiled_once_then_read_from_the_cache_dir(tmp_path, monkeypatch):
    _nvrtc()
    from moebus.cuda.kernels import flash_attention

    first = flash_attention.cubin(32, False, "sm_90", str(tmp_path))
    assert [p.suffix for p in (tmp_path / "flash_attention").iterdir()] == [".cubin"]
    monkeypatch.setattr(flash_attention, "nvrtc_compile", lambda *a, **k: pytest.fail("compiled again"))
    assert flash_attention.cubin(32, False, "sm_90", str(tmp_path)) == first
    with pytest.raises(pytest.fail.Exception):  # another head dim is another file
        flash_attention.cubin(40, False, "sm_90", str(tmp_path))


def test_a_kernel_that_cannot_be_built_leaves_the_materialised_path(monkeypatch, caplog):
    from moebus.cuda.kernels import flash_attention

    def no_nvrtc(*_):
        raise RuntimeError("libnvrtc not found")

    monkeypatch.setattr(flash_attention, "supported", lambda head_dim: True)
    monkeypatch.setattr(flash_attention, "_kernel", no_nvrtc)
    flash_attention._builds.cache_clear()
    try:
        assert not flash_attention.ready(64, False)
        assert "flash attention unavailable" in caplog.text and "libnvrtc not found" in caplog.text
    finally:
        flash_attention._builds.cache_clear()


# -- the kernel on a GPU ----------------------------------------------------------------------------

gpu = pytest.mark.skipif(SIMULATOR, reason="the flash kernel is CUDA C++: MOEBUS_TEST_GPU=1")


@gpu
@pytest.mark.parametrize("head_dim,window", [(128, 0), (64, 40), (72, 0)])
def test_prefill_kernel_matches_refs(rng, head_dim, window):
    from moebus.cuda.kernels.compat import cuda
    from moebus.cuda.kernels.flash_attention import flash_prefill_cuda
    from tests.cuda.conftest import device, poisoned

    q, k, v, slot_of, pos_of = _prefill_inputs(rng, 4, 2, head_dim, True)
    out, stream = poisoned(q.shape), cuda.stream()
    flash_prefill_cuda(device(q), device(k), device(v), SEGMENTS, head_dim ** -0.5, window, out, stream)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(got, attention_ref(q, k, v, slot_of, pos_of, head_dim ** -0.5, window), rtol=1e-4,
                               atol=3e-5)
    np.testing.assert_allclose(got, flash_prefill_ref(q, k, v, SEGMENTS, head_dim ** -0.5, window), rtol=1e-4,
                               atol=1e-5)  # the same splits: closer than to the fp32 reference


@gpu
@pytest.mark.parametrize("head_dim", [72, 128, 16])
def test_image_kernel_matches_refs(rng, head_dim):
    from moebus.cuda.kernels.compat import cuda
    from moebus.cuda.kernels.flash_attention import flash_images_cuda
    from tests.cuda.conftest import device, poisoned

    images, positions, heads = 3, 100, 2
    q, k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(3))
    out, stream = poisoned(q.shape), cuda.stream()
    flash_images_cuda(device(q), device(k), device(v), images, head_dim ** -0.5, out, stream)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(got, vision_attention_ref(q, k, v, images, head_dim ** -0.5), rtol=1e-4, atol=3e-5)


@gpu
@pytest.mark.parametrize("precision,defines", [("split_scores", ()), ("bf16", ()), ("bf16", (("MIN_BLOCKS", 2),)),
                                               ("bf16", (("STAGES_WANTED", 1),)), ("split", (("STAGES_WANTED", 1),))])
def test_image_kernel_variants_match_their_ref(rng, monkeypatch, precision, defines):
    from moebus.cuda.kernels import flash_attention
    from moebus.cuda.kernels.compat import cuda
    from tests.cuda.conftest import device, poisoned

    monkeypatch.setattr(flash_attention, "IMAGE_PRECISION", precision)
    monkeypatch.setattr(flash_attention, "IMAGE_DEFINES", defines)
    images, positions, heads, head_dim = 2, 200, 2, 72
    q, k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(3))
    out, stream = poisoned(q.shape), cuda.stream()
    flash_attention.flash_images_cuda(device(q), device(k), device(v), images, head_dim ** -0.5, out, stream)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    twin, exact = flash_images_ref(q, k, v, images, head_dim ** -0.5, precision), \
        vision_attention_ref(q, k, v, images, head_dim ** -0.5)
    # The same roundings, but a probability (or score) one fp32 ulp from a bf16 rounding boundary
    # may round the other way in the kernel (exp2f) than in numpy, moving its row by up to ~2^-9 of
    # that probability: on the H200 0.1-0.4% of the outputs moved by more than 1e-5, up to 3.8e-4.
    if precision == "split":  # no plain bf16 rounding: as close as the default build
        np.testing.assert_allclose(got, twin, rtol=1e-4, atol=1e-5)
    moved = np.abs(got - twin) > 1e-5
    assert moved.mean() < 0.01, moved.mean()
    np.testing.assert_allclose(got, twin, rtol=0, atol=2e-3)
    assert np.abs(got - exact).max() < 1e-2  # as the numpy twin's own error (test_images_ref_with_plain_...)


@gpu
@pytest.mark.parametrize("head_dim,warps", [(72, 4), (72, 8), (16, 4)])
def test_image_kernel_at_thirty_two_rows_a_warp_equals_sixteen_bit_for_bit(rng, monkeypatch, head_dim, warps):
    """Each row's products and sums are the same at either layout; its split store (proj's input) too."""
    from moebus.cuda.kernels import flash_attention
    from moebus.cuda.kernels.compat import cuda
    from tests.cuda.conftest import device, poisoned

    images, positions, heads = 2, 300, 2
    q, k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(3))
    got = {}
    for rows in (16, 32):
        monkeypatch.setattr(flash_attention, "IMAGE_WARP_ROWS", rows)
        monkeypatch.setattr(flash_attention, "IMAGE_WARPS", warps if rows == 32 else 8)
        stream = cuda.stream()
        out = poisoned(q.shape)
        planes = [cuda.device_array(shape, np.uint16) for shape in flash_attention.plane_shapes(
            images, positions, heads, head_dim)]
        flash_attention.flash_images_cuda(device(q), device(k), device(v), images, head_dim ** -0.5, out, stream,
                                          planes)
        parts = cuda.to_device(np.full((2, images * positions, heads * head_dim), 0xFFFF, np.uint16))
        flash_attention.flash_planes_cuda(device(q), *planes, images, head_dim ** -0.5, parts, stream)
        got[rows] = (out.copy_to_host(stream=stream), parts.copy_to_host(stream=stream))
        stream.synchronize()
    for a, b in zip(got[16], got[32]):
        np.testing.assert_array_equal(a, b)


@gpu
def test_planes_kernel_matches_ref(rng):
    from moebus.cuda.kernels.compat import cuda
    from moebus.cuda.kernels.flash_attention import plane_shapes, split_planes_cuda
    from tests.cuda.conftest import device

    images, positions, heads, head_dim = 2, 100, 3, 72
    k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(2))
    stream = cuda.stream()
    planes = [cuda.to_device(np.full(shape, 0xFFFF, np.uint16)) for shape in plane_shapes(images, positions, heads,
                                                                                         head_dim)]  # poisoned
    split_planes_cuda(device(k), device(v), images, *planes, stream)
    stream.synchronize()
    for got, want in zip(planes, split_planes_ref(k, v, images)):
        np.testing.assert_array_equal(got.copy_to_host(), want)


def _rope_inputs(rng, images: int, positions: int, heads: int, head_dim: int):
    """q, k, v without biases, the three biases (bf16), a 2-D rotary's positions, axes and tables
    (the tower's: mrope.vision_axes, vision_rope_tables)."""
    from moebus.cuda.kernels.mrope import vision_axes, vision_rope_tables

    q, k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(3))
    bias = f32_to_bf16(0.5 * rng.standard_normal(3 * heads * head_dim, dtype=np.float32))
    rope_pos = rng.integers(0, 12, (images * positions, 2)).astype(np.int32)
    cos, sin = vision_rope_tables(head_dim, 10000.0, 12)
    return q, k, v, bias, rope_pos, vision_axes(head_dim), cos, sin


def test_rope_planes_ref_is_the_rotary_with_biases_then_split_planes(rng):
    from moebus.cuda.kernels.flash_attention_ref import rope_planes_ref
    from moebus.cuda.kernels.mrope import mrope_ref

    images, positions, heads, head_dim = 2, 20, 3, 8
    q, k, v, bias, rope_pos, axes, cos, sin = _rope_inputs(rng, images, positions, heads, head_dim)
    q_out, k_planes, v_planes = rope_planes_ref(q, k, v, bias, rope_pos, axes, cos, sin, images)
    dim = heads * head_dim
    np.testing.assert_array_equal(q_out, mrope_ref(q, rope_pos, axes, cos, sin, bias[:dim]))
    values = v + bf16_to_f32(bias[2 * dim:]).reshape(heads, head_dim)
    want = split_planes_ref(mrope_ref(k, rope_pos, axes, cos, sin, bias[dim:2 * dim]), values, images)
    np.testing.assert_array_equal(k_planes, want[0])
    np.testing.assert_array_equal(v_planes, want[1])


@gpu
@pytest.mark.parametrize("head_dim", [72, 16])
@pytest.mark.parametrize("pairs", [False, True])  # ROPE_PAIRS: a thread per rotary pair, or per dim
def test_rope_planes_kernel_matches_ref_bit_for_bit(rng, monkeypatch, head_dim, pairs):
    from moebus.cuda.kernels.compat import cuda
    from moebus.cuda.kernels.flash_attention import plane_shapes, rope_planes_cuda
    from moebus.cuda.kernels.flash_attention_ref import rope_planes_ref
    from tests.cuda.conftest import device, poisoned

    others = tuple(d for d in flash_attention.IMAGE_DEFINES if d[0] != "ROPE_PAIRS")
    monkeypatch.setattr(flash_attention, "IMAGE_DEFINES", others + ((("ROPE_PAIRS", 1),) if pairs else ()))

    images, positions, heads = 2, 100, 3
    inputs = _rope_inputs(rng, images, positions, heads, head_dim)
    stream = cuda.stream()
    planes = [cuda.to_device(np.full(shape, 0xFFFF, np.uint16)) for shape in plane_shapes(images, positions, heads,
                                                                                         head_dim)]  # poisoned
    q_out = poisoned(inputs[0].shape)
    rope_planes_cuda(*(device(a) for a in inputs), images, q_out, *planes, stream)
    stream.synchronize()
    for got, want in zip([q_out] + planes, rope_planes_ref(*inputs, images)):
        np.testing.assert_array_equal(got.copy_to_host(), want)


@gpu
def test_rope_image_attention_matches_the_unfused_ops(rng):
    """The tower's fused path (rotary, biases and planes in one pass, then the kernel) against the
    rotary, the biases and vision_attention_ref in numpy, and against the backend's unfused ops."""
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.cuda.kernels.gemm import split_rows_cuda
    from moebus.cuda.kernels.mrope import mrope_ref
    from moebus.cuda.kernels.split_epilogues import SplitRows

    ops = CudaBackend()
    assert ops.tensor_cores is not None
    positions, heads, head_dim = 300, 4, 72
    q, k, v, bias, rope_pos, axes, cos, sin = _rope_inputs(rng, 1, positions, heads, head_dim)
    assert ops.rope_attention_ready(positions, head_dim, bias)
    assert not ops.rope_attention_ready(positions, head_dim, bf16_to_f32(bias))  # the kernel reads bf16 biases
    args = [ops.upload(a) for a in (q, k, v, bias, rope_pos, axes, cos, sin)]
    got = ops.to_host(ops.rope_image_attention(*args, head_dim ** -0.5))
    dim = heads * head_dim
    rq, rk = (mrope_ref(x, rope_pos, axes, cos, sin, bias[i * dim:(i + 1) * dim]) for i, x in enumerate((q, k)))
    rv = v + bf16_to_f32(bias[2 * dim:]).reshape(heads, head_dim)
    np.testing.assert_allclose(got, vision_attention_ref(rq, rk, rv, 1, head_dim ** -0.5), rtol=1e-4, atol=3e-5)
    uq, uk = (ops.mrope(args[i], args[4], args[5], args[6], args[7], bias=ops.upload(bias[i * dim:(i + 1) * dim]))
              for i in (0, 1))
    unfused = ops.to_host(ops.vision_attention(uq, uk, ops.upload(rv), 1, head_dim ** -0.5))
    # the mrope kernel's multiply-adds are FMAs (NVVM contracts them), rope_planes rounds each product as
    # mrope_ref does: an ulp apart at places, the outputs up to 1.3e-6 (2 of 86,400 past 1e-6, H200, vltower10)
    np.testing.assert_allclose(got, unfused, rtol=1e-5, atol=5e-6)
    # stored as the split input of a product (proj): gemm.split_rows' parts of the same values, bit for bit
    split = ops.rope_image_attention(*args, head_dim ** -0.5, next_weight=ops.upload(np.zeros((8, dim), np.uint16)))
    assert isinstance(split, SplitRows) and split.shape == (positions, dim)
    want = split_rows_cuda(ops.upload(got.reshape(positions, dim)), ops.empty((2, positions, dim), np.uint16))
    np.testing.assert_array_equal(ops.to_host(split.parts), ops.to_host(want))
