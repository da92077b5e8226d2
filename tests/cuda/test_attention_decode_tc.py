"""The tensor-core decode attention (attention_decode_tc.py, an experiment timed by decode15.sh): its .cu
compiled by NVRTC without spills (where the NVRTC wheel is installed), and on a GPU (MOEBUS_TEST_GPU=1) its
splits merged by attention_decode.merge_splits against attention_ref: ragged lengths, several tokens,
splits of every size the kernel's 16-key tiles meet (a split shorter than a warp's tile, a last tile cut
short), a group of 8 and of 4; and its merge in the split kernel (attention_decode.TC_MERGE_IN_SPLIT: a token of
one split written directly, else the last split block merges) against the merge apart, bit for bit; the
variant that waits first (attention_decode.TC_PDL: a programmatic edge into it in a captured graph) too."""
import numpy as np
import pytest

from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels.attention import attention_ref, attention_scratch_shape
from moebus.cuda.kernels.compat import SIMULATOR
from tests.cuda.conftest import device, poisoned


@pytest.mark.parametrize("warps, min_blocks", [(4, 2), (8, 1)])
def test_kernel_compiles_for_hopper_without_spills(warps, min_blocks):
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - the library itself is missing
        pytest.skip(f"NVRTC not installed: {exc}")
    from moebus.cuda.kernels.attention_decode_tc import compile_options, source
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    ptx, _ = nvrtc_compile(source(), compile_options("compute_90", warps, min_blocks), target="ptx")
    assert b".entry decode_attention_tc" in ptx and b"mma.sync.aligned.m16n8k16" in ptx
    cubin, log = nvrtc_compile(source(), compile_options("sm_90", warps, min_blocks) + [b"--ptxas-options=-v"])
    assert cubin
    if log.strip():
        lines = log.splitlines()
        at = next(i for i, line in enumerate(lines) if "entry function 'decode_attention_tc'" in line)
        assert " 0 bytes spill stores" in lines[at + 2], lines[at + 2]


def test_the_waiting_kernel_waits_first_under_its_own_name():
    """TC_PDL's variant (compile_options' ``wait``): entry PDL_ENTRY, griddepcontrol.wait before any global
    load or store (then the trigger, where pdl.trigger_after_wait), no spills; the default has no wait."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - the library itself is missing
        pytest.skip(f"NVRTC not installed: {exc}")
    from moebus.cuda.kernels import pdl
    from moebus.cuda.kernels.attention_decode_tc import ENTRY, PDL_ENTRY, compile_options, source
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    for wait in (False, True):
        ptx, _ = nvrtc_compile(source(), compile_options("compute_90", 4, 2, wait), target="ptx")
        entry = (PDL_ENTRY if wait else ENTRY).encode()
        body = ptx[ptx.index(b".entry " + entry + b"("):]
        assert (b"griddepcontrol.wait" in body) == wait
        if wait:
            at = body.index(b"griddepcontrol.wait")
            assert not any(op in body[:at] for op in (b"ld.global", b"st.global", b"atom.")), body[:at][-400:]
            assert (b"griddepcontrol.launch_dependents" in body) == pdl.trigger_after_wait()
    cubin, log = nvrtc_compile(source(), compile_options("sm_90", 4, 2, True) + [b"--ptxas-options=-v"])
    assert cubin
    if log.strip():
        lines = log.splitlines()
        at = next(i for i, line in enumerate(lines) if f"entry function '{PDL_ENTRY}'" in line)
        assert " 0 bytes spill stores" in lines[at + 2], lines[at + 2]


def test_a_registered_kernel_is_listed_as_waiting(monkeypatch):
    from moebus.cuda.kernels import pdl

    monkeypatch.setattr(pdl, "_REGISTERED", set())
    assert b"decode_attention_tc_pdl" not in pdl.waiting_functions()
    pdl.register_waiting(b"decode_attention_tc_pdl", 1234)
    assert {b"decode_attention_tc_pdl", 1234} <= pdl.waiting_functions()


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("heads, kv_heads, splits, positions", [(32, 4, 64, 32), (16, 4, 256, 8), (8, 1, 16, 64)])
def test_splits_merged_match_the_reference(rng, monkeypatch, heads, kv_heads, splits, positions):
    from moebus.cuda.kernels import attention_decode, attention_decode_tc
    from moebus.cuda.kernels.compat import cuda

    monkeypatch.setattr(attention_decode, "DECODE_SPLITS", splits)
    monkeypatch.setattr(attention_decode, "SPLIT_POSITIONS", positions)
    context = 1500
    k, v = (f32_to_bf16(rng.standard_normal((3, kv_heads, context, 128), dtype=np.float32)) for _ in range(2))
    slots, pos = np.array([1, 0, 2, 1], np.int32), np.array([context - 1, 700, 5, 63], np.int32)
    q = rng.standard_normal((4, heads, 128), dtype=np.float32)
    stream = cuda.stream()  # a cuda.core launch takes a stream object
    out, scratch = poisoned(q.shape), poisoned(attention_scratch_shape(4, heads, 128, context))
    args = (device(q), device(k), device(v), device(slots), device(pos))
    attention_decode_tc.launch(*args, 0.09, scratch, stream, splits, positions)
    attention_decode.merge_splits(128)[(4, heads), attention_decode.MERGE_THREADS, stream](args[4], 0, scratch, out)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(got, attention_ref(q, k, v, slots, pos, 0.09), atol=2e-5, rtol=1e-4)


def test_the_merge_is_in_the_split_kernel_only_where_a_token_has_few_splits(monkeypatch):
    """attention.merges_in_split: TC_MERGE_IN_SPLIT, and at most TC_MERGE_MAX_SPLITS (and MERGE_CAP) splits of
    TC_SPLIT_POSITIONS (64) positions in the cache (bench decode's 104 positions: 2; a 1k cache: 16)."""
    from moebus.cuda.kernels import attention_decode
    from moebus.cuda.kernels.attention import merges_in_split

    monkeypatch.setattr(attention_decode, "TC_MERGE_IN_SPLIT", True)
    monkeypatch.setattr(attention_decode, "TC_MERGE_MAX_SPLITS", 2)
    assert merges_in_split(104, 64) and merges_in_split(128, 64) and not merges_in_split(129, 64)
    assert not merges_in_split(1024, 64) and not merges_in_split(32768, 64)
    monkeypatch.setattr(attention_decode, "TC_MERGE_MAX_SPLITS", 1024)
    assert merges_in_split(32768, 64)  # 64 splits (DECODE_SPLITS) <= MERGE_CAP
    monkeypatch.setattr(attention_decode, "DECODE_SPLITS", 512)
    assert not merges_in_split(32768, 64)  # 512 splits: past MERGE_CAP (256)
    monkeypatch.setattr(attention_decode, "TC_MERGE_IN_SPLIT", False)
    assert not merges_in_split(104, 64)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_attention_cuda_takes_it_with_decode_tc(rng, monkeypatch):
    """attention_decode.DECODE_TC: attention_cuda's decode on tensor cores (a stream object), the merge apart."""
    from moebus.cuda.kernels import attention_decode, attention_decode_tc
    from moebus.cuda.kernels.attention import attention_cuda
    from moebus.cuda.kernels.compat import cuda

    monkeypatch.setattr(attention_decode, "DECODE_TC", True)
    k, v = (f32_to_bf16(rng.standard_normal((2, 4, 700, 128), dtype=np.float32)) for _ in range(2))
    slots, pos = np.array([1, 0], np.int32), np.array([699, 40], np.int32)
    q = rng.standard_normal((2, 32, 128), dtype=np.float32)
    stream = cuda.stream()
    assert attention_decode_tc.takes("bf16", 128, 8, stream) and not attention_decode_tc.takes("bf16", 128, 8, 0)
    out = poisoned(q.shape)
    attention_cuda(device(q), device(k), device(v), device(slots), device(pos), 0.09, 0, out, stream=stream,
                   done=device(np.zeros(8, np.int32)))
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(got, attention_ref(q, k, v, slots, pos, 0.09), atol=2e-5, rtol=1e-4)


def test_the_merge_in_the_split_kernel_takes_counters_and_output_together(rng):
    from moebus.cuda.kernels import attention_decode_tc

    q = np.zeros((1, 8, 128), np.float32)
    k = np.zeros((1, 1, 64, 128), np.uint16)
    scratch = np.zeros(attention_scratch_shape(1, 8, 128, 64), np.float32)
    with pytest.raises(ValueError, match="both"):
        attention_decode_tc.launch(q, k, k, None, None, 0.1, scratch, None, 64, 64, done=np.zeros(1, np.int32))
    big = np.zeros((1, 1, 64 * (attention_decode_tc.MERGE_CAP + 1), 128), np.uint16)
    with pytest.raises(ValueError, match="splits"):
        attention_decode_tc.launch(q, big, big, None, None, 0.1, np.zeros((1, 8, 512, 130), np.float32), None, 512,
                                   64, done=np.zeros(1, np.int32), out=q)


def _merged_and_apart(rng, monkeypatch, heads, kv_heads, splits, positions, pos, warps=0, min_blocks=0):
    """([out merged in the split kernel, twice], out merged apart, the counters after, attention_ref)."""
    from moebus.cuda.kernels import attention_decode, attention_decode_tc
    from moebus.cuda.kernels.compat import cuda

    monkeypatch.setattr(attention_decode, "DECODE_SPLITS", splits)  # the merge apart's and the scratch's
    monkeypatch.setattr(attention_decode, "SPLIT_POSITIONS", positions)

    context, num_tokens = int(pos.max()) + 1, len(pos)
    k, v = (f32_to_bf16(rng.standard_normal((3, kv_heads, context, 128), dtype=np.float32)) for _ in range(2))
    slots = np.arange(num_tokens, dtype=np.int32) % 3
    q = rng.standard_normal((num_tokens, heads, 128), dtype=np.float32)
    stream = cuda.stream()
    args = (device(q), device(k), device(v), device(slots), device(pos), 0.09)
    apart, scratch = poisoned(q.shape), poisoned(attention_scratch_shape(num_tokens, heads, 128, context))
    attention_decode_tc.launch(*args, scratch, stream, splits, positions, warps, min_blocks)
    attention_decode.merge_splits(128)[(num_tokens, heads), attention_decode.MERGE_THREADS, stream](args[4], 0,
                                                                                                   scratch, apart)
    done = device(np.zeros(num_tokens * kv_heads + 3, np.int32))
    merged = []
    for _ in range(2):  # a second launch finds the counters at 0, as a replayed graph does
        out = poisoned(q.shape)
        attention_decode_tc.launch(*args, poisoned(scratch.shape), stream, splits, positions, warps, min_blocks,
                                   done=done, out=out)
        merged.append(out.copy_to_host(stream=stream))
    stream.synchronize()
    reference = attention_ref(q, k, v, slots, pos, 0.09)
    return merged, apart.copy_to_host(), done.copy_to_host(), reference


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
@pytest.mark.parametrize("heads, kv_heads, splits, positions, warps, min_blocks", [
    (32, 4, 64, 64, 0, 0),  # the a3b shapes: 1 split up to 64 positions, 2 at 65..128, ..., 32 at 2k
    (16, 4, 256, 8, 0, 0),  # up to 256 splits (MERGE_CAP), a group of 4
    (8, 1, 16, 64, 8, 1)])  # 8 warps, at most 16 splits of longer ranges
def test_merged_in_the_split_kernel_gives_the_merge_aparts_bits(rng, monkeypatch, heads, kv_heads, splits, positions,
                                                                warps, min_blocks):
    pos = np.array([0, 5, positions - 1, positions, 2 * positions + 3, 700, 2047], np.int32)
    merged, apart, done, reference = _merged_and_apart(rng, monkeypatch, heads, kv_heads, splits, positions, pos,
                                                       warps, min_blocks)
    for out in merged:
        np.testing.assert_array_equal(out.view(np.uint32), apart.view(np.uint32))
    np.testing.assert_array_equal(done, 0)
    np.testing.assert_allclose(apart, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")
def test_attention_cuda_merges_in_the_split_kernel_with_tc_merge_in_split(rng, monkeypatch):
    """TC_MERGE_IN_SPLIT with counters: one launch, the bits of the default (the merge apart); without
    counters (or with too few) still the merge apart; TC_PDL's kernel (waits first) the same bits, listed as
    waiting; TC_GRID_SPLITS' grid too."""
    from moebus.cuda.kernels import attention_decode
    from moebus.cuda.kernels.attention import attention_cuda
    from moebus.cuda.kernels.compat import cuda

    monkeypatch.setattr(attention_decode, "DECODE_TC", True)
    monkeypatch.setattr(attention_decode, "TC_MERGE_MAX_SPLITS", 256)  # 11 splits here: merged in the split kernel
    k, v = (f32_to_bf16(rng.standard_normal((3, 4, 700, 128), dtype=np.float32)) for _ in range(2))
    slots, pos = np.array([1, 0, 2], np.int32), np.array([699, 40, 64], np.int32)
    q = rng.standard_normal((3, 32, 128), dtype=np.float32)
    stream = cuda.stream()
    args = (device(q), device(k), device(v), device(slots), device(pos), 0.09, 0)
    got = {}
    cases = ((False, 12, False, False), (True, 12, False, False), (True, 11, False, False), (False, 12, True, False),
             (True, 12, True, False), (False, 12, False, True), (True, 12, True, True))
    for in_split, counters, wait, tight in cases:
        monkeypatch.setattr(attention_decode, "TC_MERGE_IN_SPLIT", in_split)
        monkeypatch.setattr(attention_decode, "TC_PDL", wait)  # the kernel that waits first: the same bits
        monkeypatch.setattr(attention_decode, "TC_GRID_SPLITS", tight)  # 11 splits a grid, not the scratch's 22
        out, done = poisoned(q.shape), device(np.zeros(counters, np.int32))
        attention_cuda(*args, out, stream=stream, done=done)
        got[in_split, counters, wait, tight] = out.copy_to_host(stream=stream), done.copy_to_host(stream=stream)
    stream.synchronize()
    from moebus.cuda.kernels import pdl
    from moebus.cuda.kernels.attention_decode_tc import PDL_ENTRY

    assert PDL_ENTRY.encode() in pdl.waiting_functions()
    for out, done in got.values():
        np.testing.assert_array_equal(out.view(np.uint32), got[False, 12, False, False][0].view(np.uint32))
        np.testing.assert_array_equal(done, 0)
    np.testing.assert_allclose(got[True, 12, False, False][0], attention_ref(q, k, v, slots, pos, 0.09), atol=2e-5,
                               rtol=1e-4)
