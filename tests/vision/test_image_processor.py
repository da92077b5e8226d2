"""Pixel values equal transformers' SigLIP and CLIP image processors (PIL backend) to 1e-5."""
import json

import numpy as np
import pytest
from PIL import Image

from moebus.common.errors import CheckpointError
from moebus.common.image_processor import ImageProcessor, expand_image_tokens, to_rgb

transformers = pytest.importorskip("transformers")

from tests.vision_models import reference_composites_alpha  # noqa: E402

TRANSPARENT = ("rgba", "palette_transparency")
OLD_REFERENCE = ("transformers < 5.21 drops the alpha channel (convert('RGB')) where moebus, like transformers "
                 ">= 5.21, composites onto white: test_transparency_is_composited_onto_white pins moebus' pixels")

SIGLIP = dict(size={"height": 40, "width": 40})
CLIP = dict(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32})


def images():
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (61, 29, 4), dtype=np.uint8))
    gray = Image.fromarray(rng.integers(0, 256, (19, 23), dtype=np.uint8))
    palette = rgb.convert("P")
    palette.info["transparency"] = 0
    tiny = Image.fromarray(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8))
    return {"rgb": rgb, "rgba": rgba, "gray": gray, "palette_transparency": palette, "1x1": tiny}


def reference(kind, settings):
    from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

    return (SiglipImageProcessorPil if kind == "siglip" else CLIPImageProcessorPil)(**settings)


@pytest.mark.parametrize("name", list(images()))
@pytest.mark.parametrize("kind, settings", [("siglip", SIGLIP), ("clip", CLIP),
                                             ("clip", dict(size={"shortest_edge": 20}, crop_size={"height": 30, "width": 24})),
                                             ("siglip", dict(SIGLIP, resample=2, do_normalize=False))])
def test_pixel_values_equal_transformers(kind, settings, name):
    if name in TRANSPARENT and not reference_composites_alpha():
        pytest.skip(OLD_REFERENCE)
    image = images()[name]
    ref = reference(kind, settings)
    expected = ref(images=[image], return_tensors="np")["pixel_values"][0]
    ours = ImageProcessor({**ref.to_dict()}).preprocess(image)
    assert ours.shape == expected.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5)


def test_reads_processor_config_and_preprocessor_config(tmp_path):
    image = images()["rgba" if reference_composites_alpha() else "rgb"]
    ref = reference("clip", CLIP)
    ref.save_pretrained(tmp_path / "hub")  # preprocessor_config.json
    nested = tmp_path / "v5"
    nested.mkdir()
    (nested / "processor_config.json").write_text(json.dumps(
        {"image_processor": ref.to_dict(), "patch_size": 8, "num_additional_image_tokens": 1,
         "vision_feature_select_strategy": "default"}))
    expected = ref(images=[image], return_tensors="np")["pixel_values"][0]
    for d in (tmp_path / "hub", nested):
        proc = ImageProcessor.from_dir(d)
        np.testing.assert_allclose(proc.preprocess(image), expected, rtol=0, atol=1e-5)
        assert proc.image_size == (32, 32)
    assert ImageProcessor.from_dir(nested).tokens_per_image(8, "default") == 16


def test_transparency_is_composited_onto_white():
    """Whatever transformers is installed: a pixel of alpha a over white is a * c + (1 - a) * 255
    (Pillow rounds), a palette's transparent index is white, opaque pixels keep their colour."""
    rgba = np.random.default_rng(1).integers(0, 256, (7, 5, 4), dtype=np.uint8)
    rgba[0, 0, 3], rgba[0, 1, 3] = 0, 255
    alpha = rgba[..., 3:].astype(np.float64) / 255
    expected = alpha * rgba[..., :3] + (1 - alpha) * 255
    ours = np.array(to_rgb(Image.fromarray(rgba)), np.float64)
    assert np.abs(ours - expected).max() <= 1.0
    assert ours[0, 0].tolist() == [255] * 3 and ours[0, 1].tolist() == rgba[0, 1, :3].tolist()
    palette = images()["palette_transparency"]
    index, colours = np.array(palette), np.array(palette.convert("RGB"))
    want = np.where((index == 0)[..., None], 255, colours)
    assert (index == 0).any() and np.array_equal(np.array(to_rgb(palette)), want)
    channels = ImageProcessor(reference("siglip", dict(SIGLIP, do_normalize=False)).to_dict()).preprocess(
        Image.new("RGBA", (3, 2), (0, 0, 0, 0)))
    np.testing.assert_array_equal(channels, np.ones_like(channels))  # resized white, rescaled to 1


def test_unsupported_processor_and_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="neither processor_config.json"):
        ImageProcessor.from_dir(tmp_path)
    with pytest.raises(CheckpointError, match="LlavaNextImageProcessor"):
        ImageProcessor({"image_processor_type": "LlavaNextImageProcessor"})


def test_expand_image_tokens():
    assert expand_image_tokens([1, 9, 2, 9], 9, 3) == [1, 9, 9, 9, 2, 9, 9, 9]


def test_old_hub_integer_sizes_mean_shortest_edge_and_square_crop():
    old = ImageProcessor({"image_processor_type": "CLIPImageProcessor", "size": 36, "crop_size": 32})
    new = ImageProcessor(reference("clip", CLIP).to_dict())
    assert old.size == {"shortest_edge": 36} and old.image_size == (32, 32)
    image = images()["rgb"]
    np.testing.assert_array_equal(old.preprocess(image), new.preprocess(image))
