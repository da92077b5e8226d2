"""Qwen3-VL's tower on the tensor-core path (cuda/kernels/gemm.py, prefill_attention.image_attention):
every product and the attention of each block go through the backend's TensorCores, and the image's
embeddings and DeepStack features match the cpu device. In the simulator HostBlas stands in for
cuBLAS and the threshold is lowered so that a tiny image counts as many rows; on a GPU
(MOEBUS_TEST_GPU=1) cuBLAS itself runs, and a second test encodes an image large enough for the
default threshold, captured as a CUDA graph, against eager and the cpu."""
import numpy as np
import pytest

from moebus.common.qwen3vl_config import parse_qwen3_vision_config
from moebus.common.qwen3vl_tiny import qwen3vl_config, vision_tensors
from moebus.common.tiny_model import _Random, hf_config
from moebus.cuda.backends import make_backend
from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels import flash_attention
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import TensorCores
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.workers.qwen3vl_vision import Qwen3VisionModel, warm_up_side
from tests.cuda.test_prefill_tensor_cores import CountingBlas


def _tower():
    raw = qwen3vl_config(hf_config("qwen3_moe", "tiny"), "tiny", {})
    cfg = parse_qwen3_vision_config(raw)
    # bf16 weights: the tensor-core path takes them as stored (the cpu reads the same values)
    weights = {k[len("model.visual."):]: f32_to_bf16(v) for k, v in vision_tensors(raw, _Random(3, False)).items()}
    return cfg, weights


def _patches(cfg, grid_h: int, grid_w: int) -> np.ndarray:
    return np.random.default_rng(grid_h * 100 + grid_w).standard_normal((grid_h * grid_w, cfg.patch_dim)) \
        .astype(np.float32)


def test_every_product_and_attention_take_the_tensor_cores():
    from moebus.cuda.backends.cuda import CudaBackend

    cfg, weights = _tower()
    cpu, cuda = Qwen3VisionModel(cfg, weights, make_backend("cpu")), Qwen3VisionModel(cfg, weights, CudaBackend())
    blas = CountingBlas(HostBlas() if SIMULATOR else cublas_blas())
    cuda.ops.tensor_cores = TensorCores(blas, min_rows=4)  # the mergers' 6 rows count as many
    cuda.graph.enabled = False  # eager: each call is counted (a replay makes none)
    grid_h, grid_w = 4, 6
    patches = _patches(cfg, grid_h, grid_w)
    (embeds, deepstack), (want_embeds, want_deepstack) = cuda.encode(patches, grid_h, grid_w), \
        cpu.encode(patches, grid_h, grid_w)
    # split precision: 2 calls a product; per block q, k and v in one (strided-batched), proj, fc1,
    # fc2 and attention's two (none where the fused kernel runs: a GPU); the patch embedding; 2
    # products in each merger (the final one and one per DeepStack layer)
    parts = cuda.ops.tensor_cores.parts
    mergers = 1 + len(cfg.deepstack_layers)
    attention_calls = 0 if flash_attention.ready(cfg.head_dim, True) else 2
    assert blas.calls == parts * (4 * cfg.depth + 1 + 2 * mergers) + attention_calls * cfg.depth
    np.testing.assert_allclose(embeds, want_embeds, rtol=1e-4, atol=1e-4)  # 6e-6 measured (values up to 1.4)
    np.testing.assert_allclose(deepstack, want_deepstack, rtol=1e-4, atol=1e-4)


def test_bf16_products_halve_the_calls_and_stay_near_the_cpu(monkeypatch):
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.workers import qwen3vl_vision

    cfg, weights = _tower()
    cpu, cuda = Qwen3VisionModel(cfg, weights, make_backend("cpu")), Qwen3VisionModel(cfg, weights, CudaBackend())
    blas = CountingBlas(HostBlas() if SIMULATOR else cublas_blas())
    split = cuda.ops.tensor_cores = TensorCores(blas, min_rows=4)
    cuda.graph.enabled = False
    monkeypatch.setattr(qwen3vl_vision, "GEMM_PRECISION", "bf16")
    grid_h, grid_w = 4, 6
    patches = _patches(cfg, grid_h, grid_w)
    got, want = cuda.encode(patches, grid_h, grid_w), cpu.encode(patches, grid_h, grid_w)
    assert cuda.ops.tensor_cores is split  # the tower's precision only while it encodes
    attention_calls = 0 if flash_attention.ready(cfg.head_dim, True) else 2
    mergers = 1 + len(cfg.deepstack_layers)
    assert blas.calls == (4 * cfg.depth + 1 + 2 * mergers) + attention_calls * cfg.depth  # one call a product
    for plain, ref in zip(got, want):  # inputs rounded to bf16 (~2^-9): far from the split's 6e-6, near enough
        err = float(np.abs(plain - ref).max())
        assert 1e-5 < err < 1e-2 * float(np.abs(ref).max()), err  # 3e-3 of 1.2 here


def test_the_warm_up_image_reaches_the_tensor_core_threshold():
    assert warm_up_side(2) == 4  # no tensor cores: two merge windows a side
    for min_rows in (1, 4, 5, 64, 65, 100):
        side = warm_up_side(2, TensorCores(HostBlas(), min_rows=min_rows))
        windows = (side // 2) ** 2  # the merger's rows, the fewest of any product
        assert side % 2 == 0 and windows >= min_rows and (side // 2 - 1) ** 2 < max(min_rows, 4)


@pytest.mark.skipif(SIMULATOR, reason="cuBLAS and CUDA graphs need a GPU (MOEBUS_TEST_GPU=1)")
def test_a_captured_tensor_core_encode_equals_eager_and_the_cpu():
    from moebus.cuda.backends.cuda import CudaBackend

    cfg, weights = _tower()
    cpu, cuda = Qwen3VisionModel(cfg, weights, make_backend("cpu")), Qwen3VisionModel(cfg, weights, CudaBackend())
    assert cuda.ops.tensor_cores is not None and cuda.graph.enabled
    grid_h, grid_w = 18, 16  # 288 patches, 72 merged rows: over the default threshold of 65
    assert grid_h * grid_w // 4 >= cuda.ops.tensor_cores.min_rows
    patches = _patches(cfg, grid_h, grid_w)
    captured, want = cuda.encode(patches, grid_h, grid_w), cpu.encode(patches, grid_h, grid_w)
    assert cuda.graph.key == (grid_h, grid_w, "", True, True, True)  # products split, the fused passes on
    replayed = cuda.encode(patches, grid_h, grid_w)
    cuda.graph.close()
    cuda.graph.enabled = False
    eager = cuda.encode(patches, grid_h, grid_w)
    for got, ref, again, plain in zip(captured, want, replayed, eager):
        np.testing.assert_allclose(got, ref, rtol=5e-4, atol=5e-4)
        np.testing.assert_array_equal(again, got)
        np.testing.assert_allclose(plain, got, rtol=1e-5, atol=1e-5)
