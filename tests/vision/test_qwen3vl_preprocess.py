"""Qwen3-VL's preprocessing computes its rescale and normalization on the (H, W, C) pixels in rows
(common/qwen3vl_image_processor.py): the patches equal those of transformers' order of operations
(rescale in float64 then float32, then (x - mean) / std on the (C, H, W) array) bit for bit."""
import numpy as np
import pytest
from PIL import Image

from moebus.common.image_processor import to_rgb
from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor, normalize_rows, patchify


def _reference(proc: Qwen3VLImageProcessor, image: Image.Image) -> np.ndarray:
    """The processor's arithmetic as it stood before (transformers' layout and order)."""
    pixels = np.array(to_rgb(image))
    grid_h, grid_w = proc.grid(image.width, image.height)
    size = (grid_w * proc.patch_size, grid_h * proc.patch_size)
    pixels = np.array(Image.fromarray(pixels).resize(size, resample=proc.resample))
    pixels = np.moveaxis(pixels, -1, 0)
    pixels = (pixels.astype(np.float64) * proc.rescale_factor).astype(np.float32)
    pixels = (pixels - proc.mean[:, None, None]) / proc.std[:, None, None]
    return patchify(pixels.astype(np.float32), proc.patch_size, proc.merge_size, proc.temporal_patch_size).patches


@pytest.mark.parametrize("size", [(64, 64), (100, 37), (33, 90)])
def test_patches_equal_the_reference_bit_for_bit(size):
    proc = Qwen3VLImageProcessor({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "merge_size": 2,
                                  "temporal_patch_size": 2, "size": {"shortest_edge": 1024, "longest_edge": 65536}})
    rng = np.random.default_rng(size[0])
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    got, want = proc.preprocess(image).patches, _reference(proc, image)
    assert got.dtype == want.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, want)


def test_rows_normalize_as_the_channel_broadcast_does():
    rng = np.random.default_rng(1)
    pixels = rng.random((5, 7, 3), dtype=np.float32)
    mean, std = rng.random(3, dtype=np.float32), rng.random(3, dtype=np.float32) + 0.1
    np.testing.assert_array_equal(normalize_rows(pixels, mean, std), (pixels - mean) / std)
    grey = pixels[..., :1]  # one channel against three means: broadcast, as before
    np.testing.assert_array_equal(normalize_rows(grey, mean, std), (grey - mean) / std)


def _old_resized(proc: Qwen3VLImageProcessor, image: Image.Image) -> np.ndarray:
    """The resize as it stood before: through numpy and back, always."""
    pixels = np.array(to_rgb(image) if proc.do_convert_rgb else image)
    pixels = pixels[..., None] if pixels.ndim == 2 else pixels
    height, width = pixels.shape[:2]
    grid_h, grid_w = proc.grid(width, height)
    resized = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
    out = np.array(resized.resize((grid_w * proc.patch_size, grid_h * proc.patch_size), resample=proc.resample))
    return out[..., None] if out.ndim == 2 else out


@pytest.mark.parametrize("mode,size", [("RGB", (64, 48)), ("RGB", (70, 45)), ("RGBA", (50, 30)), ("P", (40, 40)),
                                       ("L", (64, 32)), ("L", (33, 47))])
@pytest.mark.parametrize("convert", [True, False])
def test_resized_pixels_equal_the_old_roundtrip(mode, size, convert):
    proc = Qwen3VLImageProcessor({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "merge_size": 2,
                                  "do_convert_rgb": convert, "size": {"shortest_edge": 1024, "longest_edge": 65536}})
    rng = np.random.default_rng(size[0])
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 4), dtype=np.uint8), mode="RGBA").convert(mode)
    got = proc.resized(image)
    assert got.dtype == np.uint8 and got.ndim == 3
    np.testing.assert_array_equal(got, _old_resized(proc, image))


@pytest.mark.parametrize("mode", ["RGBA", "CMYK", "LA"])
def test_an_image_of_other_channels_without_convert_is_named(mode):
    proc = Qwen3VLImageProcessor({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "merge_size": 2,
                                  "do_convert_rgb": False, "size": {"shortest_edge": 1024, "longest_edge": 65536}})
    image = Image.new("RGBA", (32, 32), (10, 20, 30, 255)).convert(mode)
    channels = len(image.getbands())
    with pytest.raises(ValueError, match=f"image has {channels} channels, the processor normalizes 3"):
        proc.preprocess(image)
