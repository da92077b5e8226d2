"""The chunk attention on tensor cores (attention_chunk_tc.py): its .cu compiled by NVRTC without
spills (where the NVRTC wheel is installed); the stage's choice by MOEBUS_CHUNK_ATTENTION (the
simulator keeps the decode kernel, the cpu device checks tc's tables); and on a GPU
(MOEBUS_TEST_GPU=1) the kernel against attention_tiles_ref, and a stage's mixed steps against the cpu
device, captured equal to eager."""
import numpy as np
import pytest

from moebus.cuda.backends.graphs import graphs_available
from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels.attention import attention_ref, attention_scratch_shape
from moebus.cuda.kernels.attention_chunk import (attention_tiles_cuda, attention_tiles_ref, chunk_tiles,
                                                 merge_tile_splits)
from moebus.cuda.kernels.attention_chunk_tc import partials_ref, tile_rows
from moebus.cuda.kernels.compat import SIMULATOR
from tests.cuda.conftest import device, poisoned
from tests.cuda.test_attention_chunk import _mixed_steps, _step, micro32_model  # noqa: F401 - a fixture

on_gpu = pytest.mark.skipif(SIMULATOR, reason="NVRTC kernels run on a GPU only")


def test_tiles_hold_64_pairs():
    assert tile_rows(8) == 8 and tile_rows(2) == 32 and tile_rows(128) == 0


@pytest.mark.parametrize("head_dim", [128, 64])
def test_kernel_compiles_for_hopper_without_spills(head_dim):
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - the library itself is missing
        pytest.skip(f"NVRTC not installed: {exc}")
    from moebus.cuda.kernels.attention_chunk_tc import compile_options, source
    from moebus.cuda.kernels.flash_attention import nvrtc_compile

    ptx, _ = nvrtc_compile(source(), compile_options(head_dim, "compute_90"), target="ptx")
    assert b".entry chunk_attention" in ptx and b"mma.sync.aligned.m16n8k16" in ptx
    cubin, log = nvrtc_compile(source(), compile_options(head_dim, "sm_90") + [b"--ptxas-options=-v"])
    assert cubin
    if log.strip():  # (NVRTC on the H200 at times prints no ptxas report: the tenth session's merged call)
        assert "Compiling entry function 'chunk_attention'" in log
        assert log.count(" 0 bytes spill stores") == log.count("spill stores"), log


def _inputs(rng, segments, heads, kv_heads, head_dim, context):
    slots, positions, stage_segments = _step(segments)
    q = rng.standard_normal((len(slots), heads, head_dim), dtype=np.float32)
    caches = [f32_to_bf16(rng.standard_normal((3, kv_heads, context, head_dim), dtype=np.float32)) for _ in range(2)]
    return q, caches, slots, positions, stage_segments


def test_the_merge_of_the_reference_partials_is_the_attention(rng):
    """partials_ref (what the kernel writes) through attention_chunk's merge, told the splits' keys."""
    segments = [(1, 250, 5), (0, 0, 3), (2, 40, 2)]
    q, (k, v), slots, positions, stage_segments = _inputs(rng, segments, 4, 2, 32, 300)
    tiles = chunk_tiles(stage_segments, len(slots), 2)  # tiles of 2 rows: a 1-row tail of the first chunk
    tiles = tiles[tiles[:, 1] >= 2]  # (a decode row's partials are the decode kernel's: left out here)
    partial = partials_ref(q, k, v, tiles, positions, 0.1, attention_scratch_shape(len(slots), 4, 32, 300)[2], 64)
    out = poisoned(q.shape)
    merge_tile_splits[4, 64](device(tiles), 2, device(positions), 64, device(np.nan_to_num(partial, nan=7.0)), out)
    got, want = out.copy_to_host(), attention_ref(q, k, v, slots, positions, 0.1)
    rows = np.concatenate([np.arange(f, f + n) for f, n, _ in tiles])
    np.testing.assert_allclose(got[rows], want[rows], atol=2e-6, rtol=1e-5)


@on_gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim,split_keys", [(32, 4, 128, 256), (4, 2, 64, 64), (8, 1, 128, 32)])
def test_a_chunk_beside_decode_rows_matches_the_reference(rng, monkeypatch, heads, kv_heads, head_dim, split_keys):
    """Decode rows, a chunk of several tiles deep in its context (many splits, a split that ends inside
    a key tile), a 2-row chunk from position 0; the table padded with unused tiles."""
    from moebus.cuda.kernels import attention_chunk_tc

    monkeypatch.setattr(attention_chunk_tc, "SPLIT_KEYS", split_keys)
    context = 1200
    segments = [(0, 700, 1), (2, 1100, 1), (1, 1023, 19), (2, 1150, 1), (0, 0, 2)]
    q, (k, v), slots, positions, stage_segments = _inputs(rng, segments, heads, kv_heads, head_dim, context)
    rows = tile_rows(heads // kv_heads)
    tiles = np.concatenate([chunk_tiles(stage_segments, len(slots), rows), np.zeros((2, 3), np.int32)])  # unused
    want = attention_tiles_ref(q, k, v, tiles, slots, positions, 0.1)
    from moebus.cuda.kernels.compat import cuda

    out, stream = poisoned(q.shape), cuda.stream()  # a cuda.core launch takes a stream object
    scratch = poisoned(attention_scratch_shape(len(slots), heads, head_dim, context))
    attention_tiles_cuda(device(q), device(k), device(v), device(tiles), device(slots), device(positions), 0.1, out,
                         scratch, stream=stream)
    got, partial = out.copy_to_host(stream=stream), scratch.copy_to_host(stream=stream)
    stream.synchronize()
    want_partial = partials_ref(q, k, v, tiles, positions, 0.1, partial.shape[2], split_keys)
    written = ~np.isnan(want_partial)
    np.testing.assert_allclose(partial[written], want_partial[written], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's fallback")
def test_the_simulator_keeps_the_decode_kernel(micro32_model, monkeypatch):  # noqa: F811
    from moebus.workers.local import LocalModel

    monkeypatch.delenv("MOEBUS_CHUNK_ATTENTION", raising=False)  # tc by default
    stage = LocalModel(micro32_model, device="cuda", num_slots=3, max_context=32, kv_dtype="bf16").stages[0]
    assert stage.tile_rows == 0  # off: the decode kernel takes the chunk's rows


def test_the_cpu_device_checks_the_tensor_core_tables(micro32_model, monkeypatch):  # noqa: F811
    from moebus.workers.local import LocalModel

    monkeypatch.delenv("MOEBUS_CHUNK_ATTENTION", raising=False)  # tc by default
    stage = LocalModel(micro32_model, device="cpu", num_slots=3, max_context=32, kv_dtype="bf16").stages[0]
    assert stage.tile_rows == 32  # group 2: 64 pairs
    fp32 = LocalModel(micro32_model, device="cpu", num_slots=3, max_context=32).stages[0]
    assert fp32.tile_rows == 0  # the tensor-core kernel reads bf16 caches only: off
    monkeypatch.setenv("MOEBUS_CHUNK_ATTENTION", "yes")
    with pytest.raises(ValueError, match="MOEBUS_CHUNK_ATTENTION"):
        LocalModel(micro32_model, device="cpu", num_slots=3, max_context=32)


@on_gpu
def test_mixed_steps_on_tensor_cores_match_the_cpu_device_and_capture(micro32_model, monkeypatch):  # noqa: F811
    from moebus.workers.local import LocalModel

    monkeypatch.setenv("MOEBUS_CHUNK_ATTENTION", "tc")
    prompt = list(range(40, 52))
    cpu = LocalModel(micro32_model, device="cpu", num_slots=3, max_context=32, kv_dtype="bf16")
    runs = []
    for graphs in (True, False):
        model = LocalModel(micro32_model, device="cuda", num_slots=3, max_context=32, kv_dtype="bf16")
        assert model.stages[0].tile_rows == 32
        model.stages[0].use_graphs = graphs and model.stages[0].use_graphs
        runs.append(_mixed_steps(model, prompt, steps=4))
    for want, got, eager in zip(_mixed_steps(cpu, prompt, steps=4), *runs):
        np.testing.assert_allclose(got, want, atol=1e-3)
        if graphs_available():
            np.testing.assert_array_equal(got, eager)
