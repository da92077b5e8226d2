"""The vision tower + projector against transformers' LlavaModel.get_image_features, and the
checkpoint layouts they load from."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moebus.common.checkpoint import Checkpoint  # noqa: E402
from moebus.common.errors import CheckpointError  # noqa: E402
from moebus.common.image_processor import ImageProcessor  # noqa: E402
from moebus.common.vision_config import load_vision_config  # noqa: E402
from moebus.cuda.backends import make_backend  # noqa: E402
from moebus.cuda.kernels.compat import SIMULATOR  # noqa: E402
from moebus.workers.vision_model import VisionModel, load_vision_weights  # noqa: E402
from tests.vision_models import hub_layout, in_memory_layout, make_hf_llava, sample_images  # noqa: E402

VARIANTS = {
    "siglip_default": dict(tower="siglip"),
    "siglip_full_last": dict(tower="siglip", feature_layer=-1, strategy="full", projector_act="gelu_pytorch_tanh"),
    "clip_default": dict(tower="clip", text_arch="mixtral"),
    "clip_layers_full_nobias": dict(tower="clip", feature_layer=[0, -2], strategy="full", projector_bias=False),
    "siglip_bf16": dict(tower="siglip", dtype="bf16", feature_layer=[1, -1]),
    "clip_f16": dict(tower="clip", dtype="f16"),
    # 36 px in patches of 8: the stride-8 conv leaves the last 4 rows and columns out (so400m: 384 / 14)
    "siglip_side_not_a_patch_multiple": dict(tower="siglip", image_size=36),
    "clip_side_not_a_patch_multiple": dict(tower="clip", image_size=36),
}


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            d = make_hf_llava(tmp_path_factory.mktemp(name) / "model", **VARIANTS[name])
            hf = transformers.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
            cache[name] = (d, hf)
        return cache[name]

    return get


def pixels(model_dir):
    proc = ImageProcessor.from_dir(model_dir)
    return np.stack([proc.preprocess(image) for image in sample_images()])


def hf_features(hf, pixel_values):
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=torch.tensor(pixel_values)).pooler_output
    return torch.stack(list(out)).numpy()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_encode_equals_transformers(llava, name):
    d, hf = llava(name)
    cfg = load_vision_config(d)
    model = VisionModel(cfg, load_vision_weights(d), make_backend("cpu"))
    px = pixels(d)
    ours, ref = model.encode(px), hf_features(hf, px)
    assert ours.shape == ref.shape == (3, cfg.num_image_tokens, cfg.text_hidden_size)
    assert np.abs(ours - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    assert np.abs(ref).max() > 0.5


def test_only_the_layers_up_to_the_selected_one_are_read(llava):
    d, _ = llava("siglip_default")  # 3 layers, feature layer -2: layers 0 and 1
    cfg = load_vision_config(d)
    assert cfg.num_layers == 3 and cfg.num_layers_run == 2 and cfg.feature_layers == (2,)
    names = load_vision_weights(d)
    assert any(n.startswith("encoder.layers.1.") for n in names)
    assert not any(n.startswith("encoder.layers.2.") or "post_layernorm" in n or "head" in n for n in names)


def test_every_layout_gives_the_same_weights_and_language_model(llava, tmp_path):
    d, hf = llava("clip_default")  # save_pretrained: vision_tower.*, language_model.model.* per expert
    layouts = {"hub": hub_layout(d, tmp_path / "hub"), "memory": in_memory_layout(hf, tmp_path / "memory")}
    saved, saved_ckpt = load_vision_weights(d), Checkpoint(d)
    for name, path in layouts.items():
        weights = load_vision_weights(path)
        assert weights.keys() == saved.keys(), name
        for key in saved:
            np.testing.assert_array_equal(weights[key], saved[key], err_msg=f"{name}: {key}")
        ckpt = Checkpoint(path)
        assert ckpt.config.wrapper == "llava"
        for layer, expert in ((0, 0), (2, 5)):
            for ours, ref in zip(ckpt.expert(layer, expert), saved_ckpt.expert(layer, expert)):
                np.testing.assert_array_equal(ours, ref)
        np.testing.assert_array_equal(ckpt.lm_head(), saved_ckpt.lm_head())
        np.testing.assert_array_equal(ckpt.attention(1)["q"], saved_ckpt.attention(1)["q"])
    assert any("experts.gate_up_proj" in n for n in Checkpoint(layouts["memory"]).names())


def test_encode_on_the_cuda_backend_equals_cpu_within_its_scratch_estimate(llava):
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.workers.vision_model import encode_scratch_bytes

    d, _ = llava("clip_layers_full_nobias")
    cfg = load_vision_config(d)
    weights = load_vision_weights(d)
    px = pixels(d)[:1]
    ref = VisionModel(cfg, weights, make_backend("cpu")).encode(px)
    backend = CudaBackend()
    model = VisionModel(cfg, weights, backend)
    np.testing.assert_allclose(model.encode(px), ref, rtol=1e-4, atol=1e-4)
    kept = sum(a.size * a.dtype.itemsize for k, a in model._kept.items() if k != "num_images")
    pool = model.graph.graph.pool if model.graph.graph is not None else backend.device_pool  # a GPU captures it
    held = pool.cached_bytes + kept
    assert held <= encode_scratch_bytes(cfg, 1) < 2 * held


@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU (MOEBUS_TEST_GPU=1)")
def test_the_captured_encode_equals_the_eager_one(llava):
    from moebus.cuda.backends.cuda import CudaBackend

    d, _ = llava("siglip_default")
    cfg, weights, px = load_vision_config(d), load_vision_weights(d), pixels(d)[:1]
    model = VisionModel(cfg, weights, CudaBackend())
    captured, replayed = model.encode(px), model.encode(px)
    assert model.graph.graph is not None
    model.graph.close()
    model.graph.enabled = False
    eager = model.encode(px)
    np.testing.assert_allclose(captured, eager, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(replayed, captured)


@pytest.mark.parametrize("name", ["siglip_default", "clip_default"])
def test_saved_processor_matches_the_tower_and_a_mismatch_is_named(llava, name):
    d, _ = llava(name)
    cfg = load_vision_config(d)
    proc = ImageProcessor.from_dir(d)
    proc.check_matches(cfg)
    proc.num_additional_image_tokens += 1
    with pytest.raises(CheckpointError, match="tokens"):
        proc.check_matches(cfg)
    proc.crop_size = proc.size = {"height": 16, "width": 16}
    with pytest.raises(CheckpointError, match="images"):
        proc.check_matches(cfg)


def test_a_missing_tensor_and_a_wrong_image_size_are_named(llava, tmp_path):
    d, _ = llava("siglip_default")
    broken = hub_layout(d, tmp_path / "broken")
    from moebus.common.safetensors_io import SafetensorsFile, save_file

    st = SafetensorsFile(broken / "model.safetensors")
    kept = {n: (np.array(st.array(n)), st.dtype_name(n)) for n in st.keys() if "layers.1.mlp.fc2.bias" not in n}
    save_file(kept, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"vision_tower\.vision_model\.encoder\.layers\.1\.mlp\.fc2\.bias"):
        load_vision_weights(broken)
    model = VisionModel(load_vision_config(d), load_vision_weights(d), make_backend("cpu"))
    with pytest.raises(ValueError, match="expected"):
        model.encode(np.zeros((1, 3, 16, 16), np.float32))

