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
