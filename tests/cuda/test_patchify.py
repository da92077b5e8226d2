"""cuda/kernels/patchify.py: an image's patches from its bytes, on the device, equal the host
processor's float32 patches bit for bit (a lookup of values the host computed rounds nothing)."""
import numpy as np
import pytest
from PIL import Image

from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor, patchify
from moebus.cuda.kernels.patchify import patches_shape, pixel_patches_cuda, pixel_patches_ref
from tests.cuda.conftest import device, poisoned


def _processor(patch: int = 4, merge: int = 2, temporal: int = 2) -> Qwen3VLImageProcessor:
    return Qwen3VLImageProcessor({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch,
                                  "merge_size": merge, "temporal_patch_size": temporal,
                                  "size": {"shortest_edge": 64, "longest_edge": 4096}})


def _float_patches(proc: Qwen3VLImageProcessor, pixels: np.ndarray) -> np.ndarray:
    """The processor's own float32 path: rescale and normalize every pixel, then patchify."""
    floats = np.moveaxis(proc.rescaled_normalized(pixels), -1, 0).astype(np.float32)
    return patchify(floats, proc.patch_size, proc.merge_size, proc.temporal_patch_size).patches


@pytest.mark.parametrize("sizes,shape", [((4, 2, 2), (16, 24)), ((2, 2, 3), (12, 8)), ((4, 1, 1), (8, 12))])
def test_ref_equals_the_float_path_bit_for_bit(rng, sizes, shape):
    proc = _processor(*sizes)
    pixels = rng.integers(0, 256, shape + (3,), dtype=np.uint8)
    got = pixel_patches_ref(pixels, proc.byte_values(pixels), *sizes)
    assert got.shape == patches_shape(pixels.shape, sizes[0], sizes[2]) and got.dtype == np.float32
    np.testing.assert_array_equal(got, _float_patches(proc, pixels))


@pytest.mark.parametrize("sizes,shape", [((4, 2, 2), (16, 24)), ((2, 2, 3), (12, 8)), ((16, 2, 2), (64, 32))])
@pytest.mark.parametrize("by_frame", [False, True])  # a thread per output value, or per pixel of a patch
def test_kernel_equals_the_host_processor_bit_for_bit(rng, monkeypatch, sizes, shape, by_frame):
    from moebus.cuda.kernels import patchify as module

    monkeypatch.setattr(module, "BY_FRAME", by_frame)
    proc = _processor(*sizes)
    pixels = rng.integers(0, 256, shape + (3,), dtype=np.uint8)
    values = proc.byte_values(pixels)
    out = poisoned(patches_shape(pixels.shape, sizes[0], sizes[2]))
    pixel_patches_cuda(device(pixels), device(values), out, *sizes)
    np.testing.assert_array_equal(out.copy_to_host(), _float_patches(proc, pixels))


def test_preprocess_keeps_the_bytes_and_its_patches_are_the_float_paths():
    proc = _processor()
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    prepared = proc.preprocess(image)
    assert prepared.pixels.dtype == np.uint8 and prepared.pixels.shape == (prepared.grid_h * 4, prepared.grid_w * 4, 3)
    assert prepared.values.shape == (3, 256) and prepared.values.dtype == np.float32
    np.testing.assert_array_equal(prepared.patches, _float_patches(proc, prepared.pixels))


def test_a_grey_image_without_rgb_conversion_is_patchified_on_the_host():
    proc = Qwen3VLImageProcessor({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4,
                                  "do_convert_rgb": False, "size": {"shortest_edge": 64, "longest_edge": 4096}})
    prepared = proc.preprocess(Image.fromarray(np.full((16, 16), 7, np.uint8), mode="L"))
    assert prepared.pixels is None and prepared.patches.shape[1] == 3 * 2 * 4 * 4  # broadcast to 3 means


def test_kernel_refuses_sides_off_the_merge_window():
    pixels = np.zeros((12, 16, 3), np.uint8)
    with pytest.raises(ValueError, match="multiples of 8"):
        pixel_patches_cuda(pixels, np.zeros((3, 256), np.float32), np.zeros((12, 192), np.float32), 4, 2, 2)
