"""The tensor-core decode attention (attention_decode_tc.py, an experiment timed by decode15.sh): its .cu
compiled by NVRTC without spills (where the NVRTC wheel is installed), and on a GPU (MOEBUS_TEST_GPU=1) its
splits merged by attention_decode.merge_splits against attention_ref: ragged lengths, several tokens,
splits of every size the kernel's 16-key tiles meet (a split shorter than a warp's tile, a last tile cut
short), a group of 8 and of 4."""
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
